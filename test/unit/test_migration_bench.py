"""``migration_bench.py``'s load and report: the schedule is the same for every system, the
summary counts what a user would (failed requests are not throughput, goodput meets both
SLOs), and the last line compares the best migration mode with ``off`` and the baseline."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest

import migration_bench
from migration_load import Outcome, Phase, Slo, phases, schedule, summarise

SLO = Slo(ttft_s=1.0, tpot_s=0.1)


def test_the_schedule_is_fixed_by_its_seed_and_follows_the_phases() -> None:
    plan = [Phase("p", 3, 8, 4, 2.0), Phase("d", 2, 2, 16, 1.0)]
    first, again = schedule(plan, vocab=500, seed=3), schedule(plan, vocab=500, seed=3)
    assert first == again and [r.phase for r in first] == ["p", "p", "p", "d", "d"]
    assert all(b.send_at > a.send_at for a, b in zip(first, first[1:], strict=False))
    assert [len(r.input_ids) for r in first] == [8, 8, 8, 2, 2]
    assert all(100 <= i < 500 for r in first for i in r.input_ids)
    assert schedule(plan, vocab=500, seed=4) != first
    names = [p.name for p in phases(quick=True, cycles=2)]
    assert names == ["prefill_heavy", "decode_heavy", "prefill_heavy"] * 2


def test_summary_counts_failures_out_and_goodput_against_both_slos() -> None:
    outcomes = [
        Outcome("p", 0.0, ttft_s=0.5, e2e_s=0.75, output_tokens=4),  # good: TPOT 0.083
        Outcome("p", 1.0, ttft_s=2.0, e2e_s=2.1, output_tokens=2),  # TTFT too long
        Outcome("d", 2.0, ttft_s=0.2, e2e_s=3.2, output_tokens=11),  # TPOT 0.3: too slow
        Outcome("d", 3.0, error="503: busy"),
    ]
    s = summarise(outcomes, duration_s=10.0, slo=SLO)
    assert (s.requests, s.failed) == (4, 1)
    assert s.throughput == pytest.approx(0.3) and s.goodput == pytest.approx(0.1)
    assert s.ttft_p50 == pytest.approx(0.5) and s.ttft_p99 == pytest.approx(2.0)
    assert s.tpot_p99 == pytest.approx(0.3)
    assert s.by_phase == {"p": 0.5, "d": 0.0}


def row(throughput: float, goodput: float, ttft_p99: float, moves: int = 0) -> dict:
    s = summarise([Outcome("p", 0.0, ttft_s=1.0, e2e_s=2.0, output_tokens=3)], 1.0, SLO)
    s.throughput, s.goodput, s.ttft_p99, s.moves = throughput, goodput, ttft_p99, moves
    return {"summary": asdict(s)}


def test_the_last_line_compares_the_best_mode_with_off_and_the_baseline() -> None:
    rows = {
        "banaserve_1p1d_off": row(0.5, 0.25, 20.0),
        "banaserve_1p1d_role": row(0.75, 0.5, 10.0, moves=3),
        "coloc_2_round_robin": row(1.0, 0.5, 8.0),
        # A routing ablation is never the best migration mode, however fast.
        "banaserve_1p1d_nospill": row(0.9, 0.5, 9.0),
    }
    line = migration_bench.report(rows, ("0.1", "0.2"))
    assert line == ("migration throughput_ratio=1.50 goodput_ratio=2.00 vs_best_coloc=0.75 "
                    "ttft_p99_ratio=0.50 moves=3 bytes_moved=0")  # fmt: skip
    rows["coloc_2_round_robin"] = {"error": "skipped: no sglang-router"}
    assert "vs_best_coloc=nan" in migration_bench.report(rows, ("0.1", "0.2"))
    assert math.isnan(migration_bench.ratio(1.0, 0.0))
