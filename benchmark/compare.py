"""BanaServe against what an SGLang user would run instead, under ``sglang.bench_serving``, in
one run: the instrument every performance claim stands on.

Usage: ``python benchmark/compare.py [--quick] [--repeat N] [--ablation] [--sweep]
[--systems A,B] [--workloads X,Y] [--scale F] [--model PATH] [--out DIR]
[--include DIR...] [--report-only]``

Systems (``compare_systems.py``; equal engine flags, KV pool, host pool and pinning):
``banaserve`` (2 prefill + 1 decode, pinned 0/1/0), the colocated baselines ``coloc_N_<policy>``
(N plain SGLang instances behind sglang-router, N = 2 and 3, policies ``round_robin``,
``cache_aware``, ``power_of_two``), ``coloc_hicache`` (2 instances sharing SGLang's own
HiCache file L3), stock PD ``stock_<policy>`` (mooncake_tcp, 2P+1D) and ``pd_radix`` (stock PD
with a radix cache on the decode instance). ``--ablation`` adds BanaServe without the store,
forced through the handoff (pure PD), without in-place execution, with cache_aware routing,
and without coalescing, on hotspot and cache pressure (or the ``--workloads`` named).

Workloads (``compare_workloads.py``): hotspot, zipf, cache pressure and uniform at 4 and at 128
output tokens, multi-turn chat, decode-heavy (48-256 output tokens), and bursty arrivals;
``--sweep`` adds zipf at 4 request rates for BanaServe and the best baseline on zipf
(``sweep.png``).

Clean runs: before every run each system's caches are cleared (instances, host pools, shared
L3, BanaServe's store and its gateway's prompt index), a warm-up on unrelated prompts is sent
(short and long ones: every serving path runs once before the measured run), and the caches
are cleared again; bench_serving's own warm-up (which replays the first measured
prompt) is off. ``--repeat N`` keeps, per system and workload, the run with the median
throughput, whole.

Prints the code provenance, the table, the ratios against the best baseline per workload
(and against stock PD ``cache_aware``), each system's cache budget, the attribution (queue,
prefill, decode, L3 and PD transfer per request), writes ``results.json``, ``compare.png``,
and ends with::

    compare hotspot_vs_best=… (best=…) hotspot_long_vs_best=… (best=…) zipf_vs_best=… …
    cache_pressure_vs_best=… uniform_vs_best=… uniform_long_vs_best=… chat_vs_best=…
    decode_heavy_vs_best=… ttft_p99_hotspot_vs_best=… (best=…)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_attribution as attribution  # noqa: E402
from banaserve.router.placement import HANDOFF_MIN_TOKENS, IN_PLACE_MAX_NEW_TOKENS  # noqa: E402
from banaserve.utils.processes import exit_on_sigterm  # noqa: E402
from compare_plots import plot_bars, plot_sweep  # noqa: E402
from compare_report import (  # noqa: E402
    Result,
    best_baseline,
    median_run,
    provenance,
    ratios_table,
    result_from_bench,
    results_in,
    summary_line,
    table,
)
from compare_systems import (  # noqa: E402
    ABLATIONS,
    Budget,
    Running,
    SystemSpec,
    banaserve_env,
    known_systems,
    post,
    prerequisites,
    start_system,
)
from compare_workloads import Workload, sweep_workloads, workloads  # noqa: E402

FULL_SYSTEMS = (
    *(f"coloc_{n}_{p}" for n in (2, 3) for p in ("round_robin", "cache_aware", "power_of_two")),
    "coloc_hicache", "stock_cache_aware", "stock_round_robin", "stock_power_of_two", "pd_radix",
    "banaserve", "banaserve_role",
)  # fmt: skip
#: SGLang HiCache with a shared L3 is in every run: the best baseline on most loads (RESULTS.md).
QUICK_SYSTEMS = ("coloc_2_round_robin", "coloc_hicache", "stock_cache_aware", "banaserve")
QUICK_WORKLOADS = ("hotspot", "hotspot_long", "cache_pressure", "uniform", "chat", "decode_heavy")
ABLATION_WORKLOADS = ("hotspot", "cache_pressure")
#: ``--base-tree``'s system: BanaServe's defaults from another checkout.
BASE_SYSTEM = "banaserve_base"
WARM_UP_PROMPT = "Warm-up {i}: the weather in a town that no measured prompt mentions is"
#: About 12 tokens a line: a long warm-up prompt is over BanaServe's handoff threshold twice.
WARM_UP_LINE = "Line {j} of warm-up {i}, about a town that no measured prompt mentions. "


def _generate(url: str, text: str, max_new_tokens: int = 8) -> None:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    post(f"{url}/generate", body, timeout=600)


def warm_up(running: Running) -> None:
    """Per instance, a short request and a long one through the front, on prompts no workload
    shares. The long ones go at once, so that a load-aware router spreads them, and are long
    enough, in prompt and output, for BanaServe to hand them off: every path a measured request
    takes (a long prefill, the store's writes and reads, the decode instance's load) has run
    once before the first measured run (seen: BanaServe's first run after a start was 20-40%
    slower than its repeats with short warm-ups only)."""
    n = max(1, len(running.urls))
    for i in range(n):
        _generate(running.url, WARM_UP_PROMPT.format(i=i))
    lines = 2 * HANDOFF_MIN_TOKENS // 12
    long_prompts = ["".join(WARM_UP_LINE.format(i=i, j=j) for j in range(lines))
                    for i in range(n)]  # fmt: skip
    with ThreadPoolExecutor(n) as pool:
        # More output tokens than a request BanaServe runs whole however long its prompt.
        list(pool.map(lambda text: _generate(running.url, text, 2 * IN_PLACE_MAX_NEW_TOKENS),
                      long_prompts))  # fmt: skip


def bench_argv(workload: Workload, url: str, model: str, result_file: Path) -> list[str]:
    driver = ["-m", "sglang.bench_serving"]
    if workload.bursts:
        on, off = workload.bursts
        script = str(REPO / "benchmark" / "bench_bursts.py")
        driver = [script, "--on-s", str(on), "--off-s", str(off)]
    rate = ["--request-rate", str(workload.request_rate)] if workload.request_rate else []
    return [
        sys.executable, *driver, "--backend", workload.backend, "--base-url", url, "--model", model,
        "--tokenizer", model, "--num-prompts", str(workload.num_prompts),
        "--max-concurrency", str(workload.max_concurrency), "--seed", str(workload.seed),
        "--output-file", str(result_file), "--output-details", "--disable-tqdm",
        "--warmup-requests", "0", *rate, *workload.dataset_args,
    ]  # fmt: skip


def run_workload(
    spec: SystemSpec, running: Running, workload: Workload, model: str, out: Path, kv_bytes: int
) -> Result:
    system = spec.name
    try:
        running.clear()
        warm_up(running)
        running.clear()
    except OSError as exc:
        return Result(system, workload.name, error=f"clearing caches or warming up: {exc}")
    before = [attribution.scrape(u) for u in running.urls]
    ours = spec.family == "banaserve"
    counters = attribution.gateway_counters(running.url) if ours else {}
    result_file = out / f"{system}-{workload.name}.jsonl"
    result_file.unlink(missing_ok=True)
    print(f"[compare] {system} / {workload.name}: {workload.num_prompts} requests", flush=True)
    # In ``out``: bench_serving drops a results file in its working directory.
    argv = bench_argv(workload, running.url, model, result_file)
    run = subprocess.run(argv, capture_output=True, text=True, timeout=3600, cwd=out)
    with (out / f"{system}-{workload.name}.log").open("a") as log:  # one per repeat
        log.write(run.stdout + run.stderr)
    if run.returncode != 0 or not result_file.exists():
        return Result(system, workload.name, error=(run.stderr or run.stdout)[-500:])
    data = json.loads(result_file.read_text().splitlines()[-1])
    result = result_from_bench(system, workload.name, data)
    if result.completed < workload.num_prompts:  # the rest failed: no throughput to compare
        result.error = (f"{workload.num_prompts - result.completed} of {workload.num_prompts} "
                        f"requests failed (see {system}-{workload.name}.log)")  # fmt: skip
    after = [attribution.scrape(u) for u in running.urls]
    gateway = None
    if ours:
        gateway = attribution.counters_delta(counters, attribution.gateway_counters(running.url))
    shares = attribution.attribute(before, after, running.answering, kv_bytes, gateway)
    result.attribution = asdict(shares)
    if ours:
        with contextlib.suppress(OSError):  # a saved /cluster is a diagnostic
            state = urllib.request.urlopen(f"{running.url}/cluster", timeout=30).read()
            (out / f"{system}-{workload.name}-cluster.json").write_bytes(state)

    def delta(name: str, i: int, label: str = "") -> float:
        return attribution.delta(before[i], after[i], name, label)

    n = len(running.prefill_urls)
    requests = [int(delta("sglang:num_requests_total", i)) for i in range(len(running.urls))]
    result.per_prefill, result.per_decode = requests[:n], requests[n:]
    # Instances that compute prompts: stock PD's decode instances receive the KV instead.
    computing = [i for i in range(len(running.urls)) if spec.family != "pd" or i < n]
    prompt = sum(delta("sglang:prompt_tokens_total", i) for i in computing)
    cached = sum(delta("sglang:cached_tokens_total", i) for i in computing)
    from_store = sum(delta("sglang:cached_tokens_total", i, "source=storage") for i in computing)
    result.prefill_hit_rate = cached / prompt if prompt else 0.0
    result.store_hit_rate = from_store / prompt if prompt else 0.0
    return result


def measure(
    spec: SystemSpec, chosen: list[Workload], args: argparse.Namespace, budget: Budget, out: Path,
    kv_bytes: int, budgets: dict[str, str],
) -> list[Result]:  # fmt: skip
    missing = prerequisites(spec)
    if missing:
        print(f"[compare] {spec.name} skipped: {missing}", flush=True)
        return [Result(spec.name, w.name, error=f"skipped: {missing}") for w in chosen]
    print(f"[compare] starting {spec.name}", flush=True)
    results = []
    try:
        with start_system(spec, args.model, budget, out, not args.no_pin) as running:
            budgets[spec.name] = running.cache_budget
            for workload in chosen:
                runs = [run_workload(spec, running, workload, args.model, out, kv_bytes)
                        for _ in range(args.repeat)]  # fmt: skip
                results.append(median_run(runs))
    except Exception as exc:  # noqa: BLE001 - one broken system must not sink the others
        print(f"[compare] {spec.name} failed: {exc}", flush=True)
        done = {r.workload for r in results}
        results += [Result(spec.name, w.name, error=str(exc)) for w in chosen if w.name not in done]
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="4 systems, 6 smaller workloads")
    parser.add_argument("--systems", default=None, help="comma-separated subset of systems")
    parser.add_argument("--workloads", default=None, help="comma-separated subset of workloads")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every prompt count")
    parser.add_argument("--ablation", action="store_true", help="add BanaServe's ablations")
    parser.add_argument("--sweep", action="store_true", help="request-rate sweep on zipf")
    parser.add_argument("--no-pin", action="store_true", help="do not pin instances to cores")
    parser.add_argument("--kv-tokens", type=int, default=None, help="KV pool of each instance")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=1, help="runs per workload; the median "
                        "run by throughput is reported")  # fmt: skip
    parser.add_argument(
        "--include", type=Path, nargs="*", default=[],
        help="also report the results of earlier runs in these --out folders (those a system "
        "and workload this run does not measure again; a later folder's over an earlier's)",
    )  # fmt: skip
    parser.add_argument(
        "--base-tree", type=Path, default=None,
        help="also run 'banaserve_base': BanaServe with its default flags from this checkout's "
        "python/ (say, `git worktree add /tmp/base REV`), for an A/B of two commits in one run",
    )  # fmt: skip
    parser.add_argument(
        "--report-only", action="store_true",
        help="measure no system (only the sweep, with --sweep): report the --include folders",
    )  # fmt: skip
    args = parser.parse_args()
    if args.repeat < 1 or args.scale <= 0:
        parser.error("--repeat must be at least 1 and --scale positive")
    known = known_systems()
    args.system_names = list(args.systems.split(",") if args.systems else (
        QUICK_SYSTEMS if args.quick else FULL_SYSTEMS))  # fmt: skip
    if args.report_only:
        if args.systems or args.ablation:
            parser.error("--report-only measures no system: drop --systems and --ablation")
        if not args.include:
            parser.error("--report-only needs --include with at least one earlier --out folder")
        args.system_names = []
    if args.ablation:
        args.system_names += [a for a in ABLATIONS if a not in args.system_names]
    if args.base_tree is not None:
        if not (args.base_tree / "python" / "banaserve").is_dir():
            parser.error(f"--base-tree {args.base_tree}: no python/banaserve there")
        args.system_names.append(BASE_SYSTEM)
    unknown = set(args.system_names) - set(known) - {BASE_SYSTEM}
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(known)}")
    every = workloads(args.quick, args.scale)
    names = args.workloads.split(",") if args.workloads else (
        list(QUICK_WORKLOADS) if args.quick else [w.name for w in every])  # fmt: skip
    if set(names) - {w.name for w in every}:
        parser.error(f"unknown workloads {sorted(set(names) - {w.name for w in every})}; "
                     f"known: {', '.join(w.name for w in every)}")  # fmt: skip
    args.chosen = [w for w in every if w.name in names]
    return args


def main() -> None:
    args = parse_args()
    exit_on_sigterm()  # stop every system's processes on SIGTERM too
    if args.model is None:
        from banaserve.models import default_model_path

        args.model = str(default_model_path())
    out = args.out or REPO / "benchmark" / "results" / time.strftime("compare-%Y%m%d-%H%M%S")
    out = out.resolve()  # bench_serving runs in it and writes its --output-file from there
    out.mkdir(parents=True, exist_ok=True)
    # Small enough that cache_pressure's prefixes overflow one instance's pool.
    budget = Budget(args.dtype, args.kv_tokens or (6144 if args.quick else 16384))
    kv_bytes = attribution.kv_bytes_per_token(args.model, args.dtype)
    known = known_systems()
    if args.base_tree is not None:
        known[BASE_SYSTEM] = replace(known["banaserve"], name=BASE_SYSTEM, tree=args.base_tree)
    code = provenance(banaserve_env())
    load_before = os.getloadavg()
    # A later folder's result replaces an earlier one's for the same system and workload.
    latest = {(r.system, r.workload): r for folder in args.include for r in results_in(folder)}
    included = list(latest.values())
    results: list[Result] = []
    budgets: dict[str, str] = {}
    started = time.monotonic()

    def everything() -> list[Result]:
        """This run's results, and the included ones this run did not measure again."""
        fresh = {(r.system, r.workload) for r in results}
        return [r for r in included if (r.system, r.workload) not in fresh] + results

    def save() -> None:  # after every system, so a run stopped early keeps what it measured
        (out / "results.json").write_text(json.dumps([asdict(r) for r in everything()],
                                                     indent=1))  # fmt: skip

    for name in args.system_names:
        chosen = args.chosen
        if name in ABLATIONS and not args.workloads:  # asked by name, an ablation runs them
            chosen = [w for w in chosen if w.name in ABLATION_WORKLOADS]
        results += measure(known[name], chosen, args, budget, out, kv_bytes, budgets)
        save()
    if args.sweep:
        best = best_baseline(everything(), "zipf")
        for name in ["banaserve", *([best.system] if best else [])]:
            sweep = sweep_workloads(args.quick, args.scale)
            results += measure(known[name], sweep, args, budget, out, kv_bytes, budgets)
            save()
    report(everything(), args, budget, budgets, code, load_before, time.monotonic() - started,
           out)  # fmt: skip


def report(
    results: list[Result], args: argparse.Namespace, budget: Budget, budgets: dict[str, str],
    code: str, load_before: tuple[float, ...], took_s: float, out: Path,
) -> None:  # fmt: skip
    load = ", ".join(f"{x:.2f}" for x in load_before)
    print(f"\n{code}\nmodel {args.model} ({budget.dtype}), "
          f"{'pinned' if not args.no_pin else 'unpinned'}, KV pool {budget.kv_tokens} tokens "
          f"per instance, {args.repeat} run(s) each, {took_s:.0f} s; load average before "
          f"{load}, after {', '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print("\n".join(table(results)))
    for r in results:
        if len(r.runs_req_per_s) > 1:
            rates = ", ".join(f"{x:.2f}" for x in r.runs_req_per_s)
            print(f"{r.system} / {r.workload}: req/s of each run {rates} (the median run above)")
    print("\n" + "\n".join(ratios_table(results)))
    print("\ncache budgets:")
    for name, text in budgets.items():
        print(f"  {name:<26}{text}")
    rows = [(r.system, r.workload, attribution.Attribution(**r.attribution))
            for r in results if r.attribution]  # fmt: skip
    if rows:
        attribution.print_attribution(rows)
    plot_bars([r for r in results if not r.workload.startswith("sweep_")], out / "compare.png")
    plot_sweep([r for r in results if r.workload.startswith("sweep_")], out / "sweep.png")
    if any(r.system == "banaserve_linker" for r in results):
        print(summary_line(results, "banaserve_linker"))
    print(summary_line(results))


if __name__ == "__main__":
    main()
