"""``benchmark/compare.py``'s report: the median run of repeats, ratios against the best
baseline of each workload, and the final line."""

from __future__ import annotations

from compare_report import (
    Result,
    best_baseline,
    median_run,
    ratios_table,
    summary_line,
)


def run(system: str, workload: str, rate: float, ttft_p99: float = 1.0, **kw: object) -> Result:
    return Result(system, workload, req_per_s=rate, ttft_p99_ms=ttft_p99, **kw)  # type: ignore[arg-type]


def test_repeats_report_the_median_run_whole_and_skip_failed_runs() -> None:
    runs = [
        run("coloc_2_round_robin", "hotspot", 0.9, 60_000, tpot_p99_ms=5.0, per_prefill=[90]),
        run("coloc_2_round_robin", "hotspot", 1.4, 30_000, tpot_p99_ms=1.0, per_prefill=[50]),
        Result("coloc_2_round_robin", "hotspot", error="bench_serving failed"),
        run("coloc_2_round_robin", "hotspot", 1.2, 70_000, tpot_p99_ms=9.0, per_prefill=[60]),
    ]
    median = median_run(runs)
    # Every field of the run with the median rate, not each field's own median (40 000 ms).
    assert (median.req_per_s, median.ttft_p99_ms, median.tpot_p99_ms) == (1.2, 70_000, 9.0)
    assert median.per_prefill == [60]
    assert median.runs_req_per_s == [0.9, 1.4, 1.2]
    assert not median.error


def test_median_of_an_even_count_is_the_lower_middle_run() -> None:
    runs = [run("banaserve", "zipf", rate) for rate in (3.0, 1.0, 4.0, 2.0)]
    assert median_run(runs).req_per_s == 2.0


def test_all_failed_repeats_report_the_failure() -> None:
    runs = [Result("banaserve", "uniform", error=f"failed {i}") for i in range(2)]
    assert median_run(runs).error == "failed 1"


def test_best_baseline_ignores_banaserve_its_ablations_and_failures() -> None:
    results = [
        run("banaserve", "hotspot", 9.0),
        run("banaserve_no_store", "hotspot", 8.0),
        Result("coloc_3_cache_aware", "hotspot", req_per_s=7.0, error="died"),
        run("coloc_2_round_robin", "hotspot", 2.0),
        run("stock_cache_aware", "hotspot", 1.5),
        run("coloc_2_round_robin", "uniform", 5.0),
    ]
    best = best_baseline(results, "hotspot")
    assert best is not None and best.system == "coloc_2_round_robin"
    assert best_baseline(results, "zipf") is None


def test_summary_line_names_the_best_baseline_of_each_workload() -> None:
    results = [
        run("coloc_2_round_robin", "hotspot", 2.0, 30_000),
        run("stock_cache_aware", "hotspot", 1.0, 20_000),
        run("banaserve", "hotspot", 3.0, 10_000),
        run("coloc_2_round_robin", "hotspot_long", 1.0),
        run("banaserve", "hotspot_long", 0.5),
        run("coloc_3_cache_aware", "zipf", 4.0),
        run("banaserve", "zipf", 5.0),
        run("stock_power_of_two", "cache_pressure", 0.5),
        run("banaserve", "cache_pressure", 0.75),
        run("coloc_2_round_robin", "uniform", 0.4),
        Result("banaserve", "uniform", error="down"),
    ]
    assert summary_line(results) == (
        "compare hotspot_vs_best=1.50 (best=coloc_2_round_robin) "
        "hotspot_long_vs_best=0.50 (best=coloc_2_round_robin) "
        "zipf_vs_best=1.25 (best=coloc_3_cache_aware) "
        "cache_pressure_vs_best=1.50 (best=stock_power_of_two) "
        "uniform_vs_best=nan (best=coloc_2_round_robin) "
        "uniform_long_vs_best=nan (best=none) "
        "chat_vs_best=nan (best=none) "
        "decode_heavy_vs_best=nan (best=none) "
        # TTFT p99 against the lowest of any baseline, here not the fastest one's.
        "ttft_p99_hotspot_vs_best=0.50 (best=stock_cache_aware)"
    )


def test_summary_line_of_another_banaserve_system() -> None:
    results = [run("coloc_2_round_robin", "hotspot", 1.0), run("banaserve_linker", "hotspot", 3.0)]
    assert summary_line(results, "banaserve_linker").startswith(
        "compare(banaserve_linker) hotspot_vs_best=3.00 (best=coloc_2_round_robin) "
    )


def test_ratios_table_keeps_the_ratio_over_stock_pd() -> None:
    results = [
        run("stock_cache_aware", "hotspot", 1.0),
        run("coloc_2_round_robin", "hotspot", 2.0),
        run("banaserve", "hotspot", 3.0),
    ]
    header, row = ratios_table(results)
    assert "vs stock_cache_aware" in header
    assert row.split() == ["hotspot", "3.00", "coloc_2_round_robin", "2.00", "1.50", "3.00"]
