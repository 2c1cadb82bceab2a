"""Migration under a phase-shifting load: ``python benchmark/migration_bench.py [--quick]
[--repeat 3] [--cycles 2] [--out DIR]``.

BanaServe with 1 prefill + 1 decode instance, pinned one core each, SmolLM2-135M fp32, with
``--migration off``, ``--migration role`` and no controller but every request free to run on
either instance (``_any``: the less busy core at route time), against the best colocated baseline of
``compare.py`` (two plain SGLang instances behind sglang-router ``round_robin``), in the same
run with the same engine flags (``compare_systems.instance_flags``). The load
(``migration_load.py``) shifts between prefill-heavy and decode-heavy phases. Each system runs
``--repeat`` times (caches cleared, roles reset between runs) and the run with the median
throughput is its row. Reported: throughput, goodput at the SLO (TTFT and TPOT), TTFT and TPOT
p50/p99, moves and bytes moved, the load average, a timeline of each instance's role and batch
(``timeline.png``), and last ``migration throughput_ratio=… goodput_ratio=… vs_best_coloc=…
ttft_p99_ratio=… moves=… bytes_moved=…`` (the best migration mode over ``off``, and its
throughput over the colocated baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import warm_up  # noqa: E402
from compare_systems import (  # noqa: E402
    ANY_LENGTH,
    Budget,
    SystemSpec,
    known_systems,
    prerequisites,
    start_system,
)
from migration_load import Slo, Summary, drive, phases, schedule, summarise  # noqa: E402

#: The SLO goodput counts against: a first token within 10 s (a 1024-token prefill takes a few
#: seconds on one core) and 0.5 s per output token (one request alone decodes at 0.09 s).
SLO = Slo(ttft_s=10.0, tpot_s=0.5)
MODES = {
    "banaserve_1p1d_off": SystemSpec("banaserve_1p1d_off", "banaserve", ours=True, prefill=1,
                                     decode=1),
    "banaserve_1p1d_role": SystemSpec("banaserve_1p1d_role", "banaserve", ours=True, prefill=1,
                                      decode=1, extra=("--migration", "role")),
    # The decode instance runs layers [k, L) on the prefill instance's core, k moved by the
    # layer controller (from L: nothing lent until it pays).
    "banaserve_1p1d_layer": SystemSpec("banaserve_1p1d_layer", "banaserve", ours=True,
                                       prefill=1, decode=1, extra=("--migration", "layer")),
    # The same, the controller reading the arrival trend of prompt and output tokens.
    "banaserve_1p1d_layer_predictive": SystemSpec(
        "banaserve_1p1d_layer_predictive", "banaserve", ours=True, prefill=1, decode=1,
        extra=("--migration", "layer", "--migration-predictive")),
    # No controller: every request, long ones too, may run on the instance whose core is less
    # busy at route time (issue 16's "let prefill instances take long decodes").
    "banaserve_1p1d_any": SystemSpec("banaserve_1p1d_any", "banaserve", ours=True, prefill=1,
                                     decode=1, extra=("--in-place-max-new-tokens",
                                                      str(ANY_LENGTH))),
    # The ablation of spilling (session 10): every long prompt waits for the prefill instance,
    # as before it (router/spill.py). Not a migration mode: never the "best mode".
    "banaserve_1p1d_nospill": SystemSpec("banaserve_1p1d_nospill", "banaserve", ours=True,
                                         prefill=1, decode=1, extra=("--spill-prefill", "off")),
}  # fmt: skip
#: Systems of MODES that are routing ablations of ``off``, not migration modes.
ABLATIONS = ("banaserve_1p1d_nospill",)
BASELINE = "coloc_2_round_robin"
SAMPLE_S = 1.0


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


async def sample_cluster(url: str, timeline: list[dict], stop: asyncio.Event) -> None:
    """Each instance's role and batch every :data:`SAMPLE_S` (BanaServe's ``/cluster``), and
    with layer migration each split instance's boundary and the controller's utilisation
    per core."""
    start = time.perf_counter()
    while not stop.is_set():
        try:
            state = await asyncio.to_thread(get_json, f"{url}/cluster")
            migration = state.get("migration", {})
            timeline.append({"t": time.perf_counter() - start, "instances": {
                i["name"]: {"role": i["role"], "batch": i["load"]["running_reqs"]
                            + i["load"]["queued_reqs"]} for i in state["instances"]},
                "boundaries": migration.get("boundaries", {}),
                "num_layers": migration.get("num_layers"),
                "utilisation": migration.get("utilisation", {})})  # fmt: skip
        except OSError:
            pass
        with_timeout = asyncio.wait_for(stop.wait(), SAMPLE_S)
        try:
            await with_timeout
        except TimeoutError:
            pass


async def one_run(url: str, requests: list, ours: bool) -> tuple[list, float, list[dict]]:
    timeline: list[dict] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_cluster(url, timeline, stop)) if ours else None
    outcomes, duration = await drive(url, requests)
    stop.set()
    if sampler is not None:
        await sampler
    return outcomes, duration, timeline


def measure(spec: SystemSpec, args: argparse.Namespace, requests: list, budget: Budget,
            out: Path) -> dict:  # fmt: skip
    """The median run of ``spec`` (by throughput) with its timeline, or an error."""
    missing = prerequisites(spec)
    if missing:
        return {"error": f"skipped: {missing}"}
    ours = spec.family == "banaserve"
    runs = []
    print(f"[migration] starting {spec.name}", flush=True)
    with start_system(spec, args.model, budget, out, pin=True) as running:
        for i in range(args.repeat):
            try:
                running.clear()
                warm_up(running)
                running.clear()
            except OSError as exc:  # urllib's HTTPError too: keep the runs made so far
                print(f"[migration] {spec.name}: clearing before run {i + 1} failed ({exc}); "
                      f"{len(runs)} of {args.repeat} runs kept", flush=True)  # fmt: skip
                if not runs:
                    raise
                break
            migrates = spec.migrates  # clear() put every instance home
            before = get_json(f"{running.url}/migration") if migrates else {}
            outcomes, duration, timeline = asyncio.run(one_run(running.url, requests, ours))
            summary = summarise(outcomes, duration, SLO)
            if migrates:
                after = get_json(f"{running.url}/migration")
                summary.moves = after["moves"] - before["moves"]
                summary.bytes_moved = after["bytes_moved"] - before["bytes_moved"]
            errors = sorted({o.error for o in outcomes if o.error})[:3]
            print(f"[migration] {spec.name} run {i + 1}: {summary.throughput:.3f} req/s, "
                  f"{summary.failed} failed {errors}", flush=True)  # fmt: skip
            runs.append({"summary": asdict(summary), "timeline": timeline})
    runs.sort(key=lambda r: r["summary"]["throughput"])
    median = runs[len(runs) // 2]
    median["runs"] = len(runs)
    if median["summary"]["failed"]:
        median["error"] = f"{median['summary']['failed']} requests failed"
    return median


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def report(rows: dict[str, dict], load: tuple[str, str]) -> str:
    print(f"\nSmolLM2-135M fp32, 1 core per instance; SLO TTFT <= {SLO.ttft_s:g} s, TPOT <= "
          f"{SLO.tpot_s:g} s; load average before {load[0]}, after {load[1]}")  # fmt: skip
    print(f"{'system':<24}{'req/s':>7}{'goodput':>9}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}"
          f"{'p99':>8}{'moves':>7}{'failed':>7}{'runs':>6}")  # fmt: skip
    for name, row in rows.items():
        if "summary" not in row:
            print(f"{name:<24} {row.get('error', 'no result')}")
            continue
        s = Summary(**row["summary"])
        print(f"{name:<24}{s.throughput:>7.3f}{s.goodput:>9.3f}{s.ttft_p50:>10.2f}"
              f"{s.ttft_p99:>8.2f}{s.tpot_p50:>10.3f}{s.tpot_p99:>8.3f}{s.moves:>7}"
              f"{s.failed:>7}{row.get('runs', 1):>6}")  # fmt: skip
    nan = float("nan")

    def get(name: str, key: str) -> float:
        row = rows.get(name, {})
        return float(row["summary"][key]) if "summary" in row and "error" not in row else nan

    def throughput_or_last(name: str) -> float:
        value = get(name, "throughput")
        return value if value == value else -1.0  # NaN (no result) ranks last

    off = "banaserve_1p1d_off"
    best = max((m for m in MODES if m != off and m not in ABLATIONS), key=throughput_or_last)
    summary = rows.get(best, {}).get("summary", {})
    return " ".join(
        [
            "migration",
            f"throughput_ratio={ratio(get(best, 'throughput'), get(off, 'throughput')):.2f}",
            f"goodput_ratio={ratio(get(best, 'goodput'), get(off, 'goodput')):.2f}",
            f"vs_best_coloc={ratio(get(best, 'throughput'), get(BASELINE, 'throughput')):.2f}",
            f"ttft_p99_ratio={ratio(get(best, 'ttft_p99'), get(off, 'ttft_p99')):.2f}",
            f"moves={int(summary.get('moves', 0))}",
            f"bytes_moved={int(summary.get('bytes_moved', 0))}",
        ]
    )


def plot(rows: dict[str, dict], path: Path) -> None:
    """Each BanaServe system's instances over time: batch (line) and role (shading)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[migration] no matplotlib: no timeline plot", flush=True)
        return
    ours = [(n, r) for n, r in rows.items() if r.get("timeline")]
    if not ours:
        return
    fig, axes = plt.subplots(len(ours), 1, figsize=(10, 3 * len(ours)), squeeze=False)
    shade = {"prefill": "tab:blue", "decode": "tab:orange", "mixed": "tab:green"}
    for ax, (name, row) in zip(axes[:, 0], ours, strict=True):
        samples = row["timeline"]
        names = sorted(samples[0]["instances"])
        for k, instance in enumerate(names):
            t = [s["t"] for s in samples]
            ax.plot(t, [s["instances"][instance]["batch"] for s in samples], label=instance)
            band = {"ymin": k / len(names), "ymax": (k + 1) / len(names), "alpha": 0.15, "lw": 0}
            for s in samples:
                role = s["instances"][instance]["role"]
                ax.axvspan(s["t"], s["t"] + SAMPLE_S, color=shade[role], **band)
        ax.set_title(f"{name}: batch per instance (lines), role per band (blue prefill, orange "
                     "decode, green mixed)", fontsize=9)  # fmt: skip
        plot_layers(ax, samples)
        ax.set_xlabel("s")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    print(f"[migration] timeline: {path}", flush=True)


def plot_layers(ax: object, samples: list[dict]) -> None:
    """On a second axis of ``ax``: each split instance's boundary as a share of the layers,
    k / L (steps: 1 is whole, lower lends more layers), and the layer controller's
    utilisation of each core (dotted, in cores' worth of work), where the timeline has
    them."""
    split = sorted({n for s in samples for n in s.get("boundaries", {})})
    cores = sorted({c for s in samples for c in s.get("utilisation", {}) if c.isdigit()})
    if not split:
        return
    right = ax.twinx()  # type: ignore[attr-defined]
    t = [s["t"] for s in samples]
    for instance in split:
        share = [s["boundaries"][instance] / s["num_layers"] if instance in s.get("boundaries", {})
                 else None for s in samples]  # fmt: skip
        right.step(t, share, "k--", where="post", label=f"k / L of {instance}")
    for core in cores:
        right.plot(t, [s.get("utilisation", {}).get(core) for s in samples], ":",
                   label=f"core {core} utilisation")  # fmt: skip
    right.set_ylabel("k / L; utilisation (cores)")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8, loc="upper right")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--quick", action="store_true", help="a few requests per phase")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=2, help="prefill/decode/prefill cycles")
    parser.add_argument("--kv-tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=Path("benchmark/results/migration"))
    systems = [*MODES, BASELINE]
    parser.add_argument(
        "--systems",
        default=",".join(systems),
        help=f"comma-separated subset of {', '.join(systems)} (default: all)",
    )
    args = parser.parse_args()
    if args.repeat < 1 or args.cycles < 1:
        parser.error("--repeat and --cycles must be at least 1")
    chosen = [name for name in args.systems.split(",") if name]
    unknown = sorted(set(chosen) - set(systems))
    if unknown or not chosen:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(systems)}")
    if args.model is None:
        from banaserve.models import default_model_path

        args.model = str(default_model_path())
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    requests = schedule(phases(args.quick, args.cycles), vocab)
    args.out.mkdir(parents=True, exist_ok=True)
    budget = Budget("float32", args.kv_tokens)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    # In --systems' order, so the most wanted rows come first in a run that may be cut short.
    specs = [MODES[n] if n in MODES else known_systems()[n] for n in dict.fromkeys(chosen)]
    rows = {}
    for spec in specs:
        try:
            rows[spec.name] = measure(spec, args, requests, budget, args.out)
        except Exception as exc:  # noqa: BLE001 - one broken system must not sink the others
            print(f"[migration] {spec.name} failed: {exc}", flush=True)
            rows[spec.name] = {"error": str(exc)}
        # After each system, so a run stopped early keeps what it measured.
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    plot(rows, args.out / "timeline.png")
    print(report(rows, (load_before, load_after)))


if __name__ == "__main__":
    main()
