"""The platform's stage pinning: each rank of a multi-rank CPU server is pinned to its
``SGLANG_CPU_OMP_THREADS_BIND`` entry where SGLang binds nothing itself (no AMX), never
beyond the cores the process was given, and only when the entry was set explicitly."""

from __future__ import annotations

import os
import types

import pytest

from banaserve.env import THREADS_BIND_ENV
from banaserve.platform import stage_pinning
from banaserve.platform.stage_pinning import parse_cpu_list, patch_bootstrap, pin_process


def test_cpu_lists_parse_as_sglang_writes_them() -> None:
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0,2-3") == {0, 2, 3}
    assert parse_cpu_list(" 4 - 5 ,7") == {4, 5, 7}
    assert parse_cpu_list([1, "3"]) == {1, 3}  # SGLang's NUMA-node default is a list
    with pytest.raises(ValueError):
        parse_cpu_list("")


def test_pinning_never_leaves_the_given_cores() -> None:
    allowed = os.sched_getaffinity(0)
    outside = {max(allowed) + 1000}
    assert pin_process(outside) == allowed  # nothing in common: left as it was
    assert os.sched_getaffinity(0) == allowed
    assert pin_process(allowed | outside) == allowed  # only the part it may use
    assert os.sched_getaffinity(0) == allowed


def bootstrap_module(*, amx: bool) -> tuple[types.ModuleType, list]:
    calls: list = []
    module = types.ModuleType("sglang.srt.distributed.bootstrap")

    def _init_cpu_threads_env(*, local_omp_cpuid, dist_init_method=None) -> None:  # noqa: ANN001
        calls.append(("sglang", local_omp_cpuid, dist_init_method))

    module._init_cpu_threads_env = _init_cpu_threads_env
    module._is_cpu_amx_available = amx
    module._is_cpu_arm64 = False
    patch_bootstrap(module)
    patch_bootstrap(module)  # idempotent: one wrapper
    return module, calls


@pytest.mark.parametrize(
    ("amx", "bind", "pinned"),
    [(False, "0|1", True), (False, "", False), (True, "0|1", False)],
    ids=["no-amx-explicit", "no-amx-unset", "amx-sglang-binds"],
)
def test_a_rank_is_pinned_only_where_sglang_does_not_bind(
    monkeypatch: pytest.MonkeyPatch, amx: bool, bind: str, pinned: bool
) -> None:
    pins: list[set[int]] = []
    monkeypatch.setattr(stage_pinning, "pin_process", lambda cores: pins.append(cores) or cores)
    monkeypatch.setattr("torch.set_num_threads", lambda n: pins.append({-n}))
    monkeypatch.setenv(THREADS_BIND_ENV, bind)
    module, calls = bootstrap_module(amx=amx)
    module._init_cpu_threads_env(local_omp_cpuid="1", dist_init_method="tcp://h:1")
    assert calls == [("sglang", "1", "tcp://h:1")]  # SGLang's own step always runs
    assert pins == ([{1}, {-1}] if pinned else [])
