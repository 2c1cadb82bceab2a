"""``compare.py``'s results and report: one row per system and workload, the repeat whose
throughput is the median, ratios against the best baseline of each workload, and the final line.

A *baseline* is every system that is not BanaServe's (names not starting with ``banaserve``:
its variants and ablations are rows of the table, never "the best baseline").
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: The final line's workloads, in order.
SUMMARY_WORKLOADS = ("hotspot", "hotspot_long", "zipf", "cache_pressure", "uniform",
                     "uniform_long", "chat", "decode_heavy")  # fmt: skip
STOCK_PD = "stock_cache_aware"


@dataclass
class Result:
    system: str
    workload: str
    req_per_s: float = 0.0
    output_tok_per_s: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    tpot_p50_ms: float = 0.0
    tpot_p99_ms: float = 0.0
    duration_s: float = 0.0
    completed: int = 0
    per_prefill: list[int] = field(default_factory=list)
    per_decode: list[int] = field(default_factory=list)
    prefill_hit_rate: float = 0.0  # prompt tokens found cached, on the instance or in L3
    store_hit_rate: float = 0.0  # of the prompt tokens, those loaded from L3 (the store)
    error: str = ""
    #: With ``--repeat``: req/s of every completed run; the row is the median one's, whole.
    runs_req_per_s: list[float] = field(default_factory=list)
    #: :class:`compare_attribution.Attribution` of this run, as a dict.
    attribution: dict[str, Any] = field(default_factory=dict)


def is_baseline(system: str) -> bool:
    return not system.startswith("banaserve")


def result_from_bench(system: str, workload: str, data: dict[str, Any]) -> Result:
    """A result from one line of ``bench_serving --output-file``."""
    return Result(
        system, workload, req_per_s=data["request_throughput"],
        output_tok_per_s=data["output_throughput"], ttft_p50_ms=data["median_ttft_ms"],
        ttft_p99_ms=data["p99_ttft_ms"], tpot_p50_ms=data["median_tpot_ms"],
        tpot_p99_ms=data["p99_tpot_ms"], duration_s=data["duration"],
        completed=data["completed"],
    )  # fmt: skip


def results_in(folder: Path) -> list[Result]:
    """Results of an earlier run: ``results.json``, or else its ``SYSTEM-WORKLOAD.jsonl``
    bench files (a run that was stopped early; no per-instance counts then)."""
    saved = folder / "results.json"
    if saved.exists():
        known = Result.__dataclass_fields__
        return [Result(**{k: v for k, v in r.items() if k in known})
                for r in json.loads(saved.read_text())]  # fmt: skip
    out = []
    for path in sorted(folder.glob("*-*.jsonl")):
        system, workload = path.stem.rsplit("-", 1)
        out.append(
            result_from_bench(system, workload, json.loads(path.read_text().splitlines()[-1]))
        )
    return out


def median_run(runs: list[Result]) -> Result:
    """One row for repeated runs of a system on a workload: the completed run whose req/s is
    the median (the lower middle one of an even count), whole, so its fields belong together;
    with every run's req/s. If no run completed, the last failure."""
    done = sorted((r for r in runs if not r.error), key=lambda r: r.req_per_s)
    if not done:
        return runs[-1]
    middle = done[(len(done) - 1) // 2]
    return replace(middle, runs_req_per_s=[r.req_per_s for r in runs if not r.error])


def get(results: list[Result], system: str, workload: str) -> Result | None:
    return next((r for r in results if r.system == system and r.workload == workload
                 and not r.error), None)  # fmt: skip


def best_baseline(results: list[Result], workload: str, metric: str = "req_per_s",
                  lowest: bool = False) -> Result | None:  # fmt: skip
    """The baseline with the highest ``metric`` on ``workload`` (``lowest``: the lowest)."""
    rows = [r for r in results if r.workload == workload and is_baseline(r.system)
            and not r.error]  # fmt: skip
    if not rows:
        return None
    pick = min if lowest else max
    return pick(rows, key=lambda r: getattr(r, metric))


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "nan"


def summary_line(results: list[Result], system: str = "banaserve") -> str:
    """``compare <workload>_vs_best=R (best=NAME) … ttft_p99_hotspot_vs_best=R (best=NAME)``:
    ``system``'s req/s over the best baseline's of each workload, and its hotspot TTFT p99 over
    the lowest of any baseline. A system other than ``banaserve`` is named in the first word."""
    parts = ["compare" if system == "banaserve" else f"compare({system})"]
    for workload in SUMMARY_WORKLOADS:
        ours, best = get(results, system, workload), best_baseline(results, workload)
        rate = ratio(ours.req_per_s if ours else None, best.req_per_s if best else None)
        parts.append(f"{workload}_vs_best={rate} (best={best.system if best else 'none'})")
    ours = get(results, system, "hotspot")
    best = best_baseline(results, "hotspot", "ttft_p99_ms", lowest=True)
    p99 = ratio(ours.ttft_p99_ms if ours else None, best.ttft_p99_ms if best else None)
    parts.append(f"ttft_p99_hotspot_vs_best={p99} (best={best.system if best else 'none'})")
    return " ".join(parts)


def ratios_table(results: list[Result], system: str = "banaserve") -> list[str]:
    """Per workload: ``system``'s req/s, the best baseline's, the ratio, and the ratio over
    stock PD ``cache_aware`` (the comparison of earlier runs)."""
    lines = [f"{'workload':<22}{system + ' req/s':>18}  {'best baseline':<24}{'req/s':>7}"
             f"{'ratio':>7}{'vs ' + STOCK_PD:>24}"]  # fmt: skip
    for workload in dict.fromkeys(r.workload for r in results):
        ours, best = get(results, system, workload), best_baseline(results, workload)
        stock = get(results, STOCK_PD, workload)
        if ours is None and best is None:
            continue
        lines.append(
            f"{workload:<22}{ours.req_per_s if ours else float('nan'):>18.2f}  "
            f"{best.system if best else 'none':<24}{best.req_per_s if best else float('nan'):>7.2f}"
            f"{ratio(ours.req_per_s if ours else None, best.req_per_s if best else None):>7}"
            f"{ratio(ours.req_per_s if ours else None, stock.req_per_s if stock else None):>24}"
        )
    return lines


def per_instance(r: Result) -> str:
    """Requests each prefill | each decode instance served, e.g. ``43,43|10``."""
    return f"{','.join(map(str, r.per_prefill))}|{','.join(map(str, r.per_decode)) or '?'}"


def table(results: list[Result]) -> list[str]:
    lines = [f"{'system':<26}{'workload':<22}{'req/s':>7}{'out tok/s':>10}{'TTFT p50':>10}"
             f"{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'dur s':>7}  {'requests P|D':<17}"
             "hit (L3)"]  # fmt: skip
    for r in results:
        if r.error:
            lines.append(f"{r.system:<26}{r.workload:<22}  FAILED: {r.error.splitlines()[-1:]}")
            continue
        lines.append(
            f"{r.system:<26}{r.workload:<22}{r.req_per_s:>7.2f}{r.output_tok_per_s:>10.1f}"
            f"{r.ttft_p50_ms:>10.0f}{r.ttft_p99_ms:>9.0f}{r.tpot_p50_ms:>10.1f}"
            f"{r.tpot_p99_ms:>8.1f}{r.duration_s:>7.1f}  {per_instance(r):<17}"
            f"{r.prefill_hit_rate:>4.0%} ({r.store_hit_rate:.0%})"
        )
    return lines


def _git(*args: str) -> str:
    run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO)
    return run.stdout.strip() if run.returncode == 0 else ""


def provenance(env: dict[str, str]) -> str:
    """Which code ran: the commit (and uncommitted changes), and whether the processes import
    the installed package or this source tree, and if installed whether it matches the tree."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = [line for line in _git("status", "--porcelain", "python").splitlines() if line]
    head = f"commit {commit}" + (f" + {len(dirty)} uncommitted change(s) in python/" if dirty
                                 else "")  # fmt: skip
    code = "import banaserve, os; print(os.path.dirname(banaserve.__file__))"
    probe = [sys.executable, "-c", code]
    run = subprocess.run(probe, capture_output=True, text=True, env=env, cwd="/")
    where = Path(run.stdout.strip()) if run.returncode == 0 else None
    source = REPO / "python" / "banaserve"
    if where is None:
        return f"{head}; banaserve does not import"
    if where.resolve() == source.resolve():
        return f"{head}; processes run the source tree"
    differ = [
        str(path.relative_to(source))
        for path in sorted(source.rglob("*.py"))
        if not (where / path.relative_to(source)).is_file()
        or _digest(where / path.relative_to(source)) != _digest(path)
    ]
    state = (
        "matches the source tree"
        if not differ
        else (f"differs from the source tree in {len(differ)} file(s): {', '.join(differ[:5])}")
    )
    return f"{head}; processes run the installed package ({where}), which {state}"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
