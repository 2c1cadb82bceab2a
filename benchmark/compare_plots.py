"""``compare.py``'s figures (need matplotlib: ``pip install '.[bench]'``): throughput and TTFT
p99 per workload and system, and the request-rate sweep (throughput and TTFT p99 against the
offered rate, the paper's style of figure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compare_report import Result


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[compare] matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    return plt


def plot_bars(results: list[Result], path: Path) -> None:
    plt = _pyplot()
    if plt is None or not results:
        return
    names = list(dict.fromkeys(r.workload for r in results))
    systems = list(dict.fromkeys(r.system for r in results))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.4 * len(names)), 8))
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        by = {r.workload: r for r in results if r.system == system and not r.error}
        xs = [i + k * width for i in range(len(names))]
        axes[0].bar(xs, [by[w].req_per_s if w in by else 0 for w in names], width, label=system)
        axes[1].bar(xs, [by[w].ttft_p99_ms / 1000 if w in by else 0 for w in names], width)
    for ax, title in zip(axes, ("throughput (req/s)", "TTFT p99 (s)"), strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"[compare] plot: {path}")


def plot_sweep(results: list[Result], path: Path) -> None:
    plt = _pyplot()
    if plt is None or not results:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system in dict.fromkeys(r.system for r in results):
        rows = sorted((r for r in results if r.system == system and not r.error),
                      key=lambda r: float(r.workload.removeprefix("sweep_")))  # fmt: skip
        rates = [float(r.workload.removeprefix("sweep_")) for r in rows]
        axes[0].plot(rates, [r.req_per_s for r in rows], marker="o", label=system)
        axes[1].plot(rates, [r.ttft_p99_ms / 1000 for r in rows], marker="o", label=system)
    for ax, title in zip(axes, ("throughput (req/s)", "TTFT p99 (s)"), strict=True):
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"[compare] sweep plot: {path}")
