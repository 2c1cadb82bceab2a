"""``benchmark/compare.py``'s systems get equal engine flags and budgets, its workloads fixed
seeds, and the burst schedule its on/off periods."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench_bursts import off_until
from compare_systems import Budget, SystemSpec, instance_argv, known_systems
from compare_workloads import SWEEP_RATES, sweep_workloads, workloads


def parsed(argv: list[str]) -> argparse.Namespace:
    """``argv`` (``python -m MODULE flags…``) through the parser its program uses."""
    from banaserve.config.cli import build_parser

    flags = argv[argv.index("-m") + 2 :]
    # BanaServe's parser is SGLang's with BanaServe's group, so it reads every system's flags.
    args, _ = build_parser().parse_known_args(flags)
    return args


@pytest.mark.parametrize("budget", [Budget(), Budget("bfloat16", 4096, 1.5, 1.0)])
def test_every_system_gets_the_same_engine_flags(tmp_path: Path, budget: Budget) -> None:
    systems = known_systems()
    args = {
        name: parsed(instance_argv(spec, "/models/m", budget, tmp_path))
        for name, spec in systems.items()
    }
    for name, a in args.items():
        assert (a.model_path, a.dtype, a.max_total_tokens, a.page_size) == (
            "/models/m", budget.dtype, budget.kv_tokens, 16,
        ), name  # fmt: skip
        assert a.enable_metrics and a.sleep_on_idle, name
    # Every system that keeps a host KV pool keeps the same one.
    keeps_one = {n for n, a in args.items() if a.enable_hierarchical_cache} | {
        n for n, s in systems.items() if s.family == "banaserve" and "none" not in s.extra
    }
    host_pools = {n: args[n].hicache_ratio for n in keeps_one}
    assert "coloc_hicache" in host_pools and "banaserve" in host_pools
    assert set(host_pools.values()) == {budget.host_ratio}
    assert args["banaserve"].kv_store_capacity_gb == budget.store_gb


def test_colocated_systems_cover_both_layouts_and_every_policy() -> None:
    coloc = {(s.instances, s.policy) for s in known_systems().values() if s.family == "coloc"}
    for n in (2, 3):
        for policy in ("round_robin", "cache_aware", "power_of_two"):
            assert (n, policy) in coloc


def test_workloads_have_distinct_seeds_and_both_output_lengths() -> None:
    every = workloads(quick=False)
    assert len({w.seed for w in every}) == len(every)
    for name in ("hotspot", "zipf", "cache_pressure", "uniform"):
        short = next(w for w in every if w.name == name)
        long_ = next(w for w in every if w.name == f"{name}_long")
        assert "4" in short.dataset_args and "128" in long_.dataset_args
    zipf = next(w for w in every if w.name == "zipf")
    assert zipf.dataset_args[-4:] == ("--gsp-group-distribution", "zipf", "--gsp-zipf-alpha", "1.1")
    assert zipf.num_prompts % 8 == 0


@pytest.mark.parametrize("scale", [0.1, 0.25, 1.0])
def test_cache_pressure_reuses_every_prefix_at_any_scale(scale: float) -> None:
    for w in workloads(quick=False, scale=scale):
        if w.name.startswith("cache_pressure"):
            args = dict(zip(w.dataset_args[::2], w.dataset_args[1::2], strict=True))
            assert int(args["--gsp-prompts-per-group"]) >= 2
            assert int(args["--gsp-num-groups"]) * int(args["--gsp-prompts-per-group"]) == (
                w.num_prompts
            )


def test_sweep_sends_the_same_prompts_at_each_rate() -> None:
    sweep = sweep_workloads(quick=True)
    assert [w.request_rate for w in sweep] == list(SWEEP_RATES)
    assert len({(w.dataset_args, w.seed, w.num_prompts) for w in sweep}) == 1


def test_burst_schedule() -> None:
    # 6 s on, 12 s off, from t=100.
    assert off_until(100.0, 100.0, 6.0, 12.0) == 0.0
    assert off_until(100.0, 105.9, 6.0, 12.0) == 0.0
    assert off_until(100.0, 106.0, 6.0, 12.0) == pytest.approx(12.0)
    assert off_until(100.0, 115.0, 6.0, 12.0) == pytest.approx(3.0)
    assert off_until(100.0, 118.5, 6.0, 12.0) == 0.0  # the second burst


def test_systems_that_migrate_are_reset_between_runs() -> None:
    systems = known_systems()
    assert systems["banaserve_role"].migrates and systems["banaserve_layer"].migrates
    assert not systems["banaserve"].migrates and not systems["coloc_2_round_robin"].migrates
    assert not SystemSpec("x", "banaserve", extra=("--migration", "off")).migrates
