"""``benchmark/compare.py`` end to end on the tiny model: the colocated baseline
(``coloc_2_round_robin``: two plain SGLang instances behind sglang-router) starts, runs a
workload from a cleared and warmed-up state, and gives a result row with its attribution."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from compare import measure
from compare_attribution import kv_bytes_per_token
from compare_systems import Budget, known_systems
from compare_workloads import Workload, shared_prefix_args

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="needs pip sglang-router"
)


def test_coloc_2_round_robin_gives_a_result_row(tiny_model: Path, tmp_path: Path) -> None:
    # One request at a time, so which requests find the shared prompt cached does not depend
    # on timing.
    workload = Workload("hotspot", shared_prefix_args(1, 6, 96, 4), 6, 1, seed=1)
    args = argparse.Namespace(model=str(tiny_model), no_pin=True, repeat=1)
    budget = Budget(kv_tokens=4096)
    budgets: dict[str, str] = {}
    spec = known_systems()["coloc_2_round_robin"]
    kv_bytes = kv_bytes_per_token(str(tiny_model), budget.dtype)
    (result,) = measure(spec, [workload], args, budget, tmp_path, kv_bytes, budgets)
    assert not result.error, result.error
    assert (result.system, result.workload, result.completed) == (spec.name, "hotspot", 6)
    assert result.req_per_s > 0 and result.runs_req_per_s == [result.req_per_s]
    # Round robin over two instances; the warm-up's requests are not counted.
    assert result.per_prefill == [] and sorted(result.per_decode) == [3, 3]
    # Caches were cleared before the run: the first request on each instance computes the
    # shared prompt (96 of about 130 tokens), the other four find it.
    assert 0.3 < result.prefill_hit_rate < 0.7
    assert result.attribution["requests"] == 6
    assert result.attribution["prefill_s"] > 0 and result.attribution["decode_s"] > 0
    assert budgets[spec.name] == "KV 4096 tok x 2"
