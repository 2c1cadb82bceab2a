"""The CPU cluster's host-memory plan: what it counts and what it names when it cannot fit.

That the cluster command refuses such a plan before any process starts is
``e2e/test_memory_plan_cli.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from banaserve.cluster.run import memory_plan
from banaserve.launch_server import plan_launch
from banaserve.server import kv_pool_sizing
from banaserve.server.memory_plan import (
    GIB,
    PROCESS_BYTES,
    MemoryPlanError,
    host_pool_ratio,
    plan_memory,
    weights_bytes,
)


def test_host_pool_ratio_follows_sglang_flags() -> None:
    assert host_pool_ratio(True, None, 0) == 2.0  # SGLang's default --hicache-ratio
    assert host_pool_ratio(True, 1.5, 0) == 1.5
    assert host_pool_ratio(True, 1.5, 4.0) == 0.0  # a fixed --hicache-size does not follow
    assert host_pool_ratio(False, 3.0, 0) == 0.0  # linker mode: no host pool


def test_the_kv_budget_covers_the_host_pool_too(tiny_model: Path) -> None:
    per_token = kv_pool_sizing.kv_bytes_per_token(tiny_model)
    alone = kv_pool_sizing.size_kv_pool(tiny_model, 0.3, available=per_token * 100_000)
    shared = kv_pool_sizing.size_kv_pool(
        tiny_model, 0.3, available=per_token * 100_000, host_ratio=2.0
    )
    assert (alone.tokens, shared.tokens) == (30_000, 10_000)


def test_plan_counts_every_pool(tiny_model: Path) -> None:
    per_token = kv_pool_sizing.kv_bytes_per_token(tiny_model)
    weights = weights_bytes(tiny_model)
    assert weights > 0
    assert weights_bytes(tiny_model, "bfloat16") == weights // 2  # the tiny model is fp32
    plan = plan_memory(tiny_model, 3, 1000, "auto", 2.0, 0.0, 1.5, available=64 * GIB)
    assert plan.kv_pool_bytes == 1000 * per_token
    assert plan.host_pool_bytes == 2000 * per_token
    assert plan.total_bytes == 3 * (3000 * per_token + weights + PROCESS_BYTES) + int(1.5 * GIB)
    fixed = plan_memory(tiny_model, 1, 1000, "auto", 0.0, 4.0, 0.0, available=64 * GIB)
    assert fixed.host_pool_bytes == 4 * 10**9  # --hicache-size is in GB, as in SGLang
    plan.check()  # fits: no error


def test_a_plan_that_does_not_fit_names_what_to_lower(tiny_model: Path) -> None:
    plan = plan_memory(tiny_model, 2, 1000, "auto", 2.0, 0.0, 20.0, available=8 * GIB)
    with pytest.raises(MemoryPlanError) as caught:
        plan.check()
    message = str(caught.value)
    assert "20.00 store" in message and "of 8.00 GiB available" in message
    assert "--kv-store-capacity-gb" in message and "--hicache-ratio" in message


def test_cluster_plan_from_flags(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BANASERVE_PLATFORM", "cpu")
    argv = ["--model-path", str(tiny_model), "--num-prefill", "2", "--num-decode", "1",
            "--max-total-tokens", "4096", "--kv-store-capacity-gb", "1.5",
            "--hicache-ratio", "1.5"]  # fmt: skip
    plan = plan_launch(argv)
    assert plan.kv_store is not None and plan.kv_store.embedded  # a cluster's own store
    assert plan.kv_store.capacity_gb == 1.5
    memory = memory_plan(plan.flags, plan.kv_store, str(tiny_model), 3)
    assert memory is not None
    per_token = kv_pool_sizing.kv_bytes_per_token(tiny_model)
    assert (memory.instances, memory.kv_pool_bytes) == (3, 4096 * per_token)
    assert memory.host_pool_bytes == int(1.5 * 4096 * per_token)
    assert memory.store_bytes == int(1.5 * GIB)
    no_defaults = plan_launch([*argv, "--no-cpu-defaults"]).flags
    assert memory_plan(no_defaults, plan.kv_store, str(tiny_model), 3) is None
