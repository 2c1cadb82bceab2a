"""``benchmark/compare.py``'s report: medians over repeated runs and the summary line."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

from compare import Result, median_result, summary_line  # noqa: E402


def run(system: str, workload: str, rate: float, ttft_p99: float, **kw: object) -> Result:
    return Result(system, workload, req_per_s=rate, ttft_p99_ms=ttft_p99, **kw)  # type: ignore[arg-type]


def test_repeats_report_each_measure_s_median_and_skip_failed_runs() -> None:
    runs = [
        run("stock_cache_aware", "hotspot", 0.9, 60_000, per_prefill=[90, 6]),
        run("stock_cache_aware", "hotspot", 1.4, 30_000, per_prefill=[50, 46]),
        Result("stock_cache_aware", "hotspot", error="bench_serving failed"),
        run("stock_cache_aware", "hotspot", 1.2, 40_000, per_prefill=[60, 36]),
    ]
    median = median_result(runs)
    assert median.req_per_s == 1.2 and median.ttft_p99_ms == 40_000
    assert median.per_prefill == [60, 36]  # the counts of the run with the median rate
    assert median.runs_req_per_s == [0.9, 1.4, 1.2]
    assert not median.error


def test_all_failed_repeats_report_the_failure() -> None:
    runs = [Result("banaserve", "uniform", error=f"failed {i}") for i in range(2)]
    assert median_result(runs).error == "failed 1"


def test_summary_line_ratios() -> None:
    results = [
        run("stock_cache_aware", "hotspot", 1.0, 40_000),
        run("stock_round_robin", "hotspot", 1.25, 30_000),
        run("banaserve", "hotspot", 2.0, 20_000),
        run("stock_cache_aware", "cache_pressure", 0.4, 1),
        run("stock_power_of_two", "cache_pressure", 0.5, 1),
        run("banaserve", "cache_pressure", 0.75, 1),
        run("stock_cache_aware", "uniform", 0.4, 1),
        Result("banaserve", "uniform", error="down"),
    ]
    assert summary_line(results) == (
        "compare hotspot_throughput_ratio=2.00 hotspot_ttft_p99_ratio=0.50 "
        "hotspot_vs_best_stock=1.60 cache_pressure_throughput_ratio=1.50 "
        "uniform_throughput_ratio=nan"
    )


def test_summary_line_of_another_banaserve_system() -> None:
    results = [
        run("stock_cache_aware", "hotspot", 1.0, 40_000),
        run("banaserve", "hotspot", 2.0, 20_000),
        run("banaserve_linker", "hotspot", 3.0, 10_000),
    ]
    assert summary_line(results, "banaserve_linker") == (
        "compare(banaserve_linker) hotspot_throughput_ratio=3.00 hotspot_ttft_p99_ratio=0.25 "
        "hotspot_vs_best_stock=3.00 cache_pressure_throughput_ratio=nan "
        "uniform_throughput_ratio=nan"
    )
