"""BanaServe against SGLang PD as it ships, under ``sglang.bench_serving``, in one run.

Usage: ``python benchmark/compare.py [--quick] [--repeat N] [--model PATH] [--out DIR]``

Systems, all with the same model, the same 2 prefill + 1 decode topology and the same core
pinning (each instance ``taskset`` to its share of the cores, ``OMP_NUM_THREADS`` to match):

- ``stock_cache_aware``: SGLang PD (``mooncake_tcp``) behind ``sglang_router --pd-disaggregation``
  with ``cache_aware`` (sglang-router's default policy);
- ``stock_round_robin`` and ``stock_power_of_two``: the same with load-only policies (balance
  without a shared cache);
- ``banaserve``: ``launch_server --num-prefill 2 --num-decode 1`` (load_aware routing, the
  Global KV Cache Store, KV handoff and in-flight coalescing through it);
- ``banaserve_linker`` (only when named in ``--systems``): the same with
  ``--kv-store-mode linker``, the layer-wise handoff. The final line always uses ``banaserve``;
  a ``compare(banaserve_linker) …`` line before it gives the same ratios for this system.

Workloads (prefill-heavy, 4 output tokens, so routing and cache effects show on 2 cores):

- ``hotspot``: one long shared system prompt takes every request (``generated-shared-prefix``
  with one group);
- ``cache_pressure``: many long prefixes, more than one instance's KV pool holds, each reused
  later in shuffled order;
- ``uniform``: ``random-ids``, nothing shared.

Each system starts once and runs every workload (instance caches flushed in between; the
store keeps its pages, which no other workload's prompts share). Prints a table (req/s,
output tok/s, TTFT and TPOT p50/p99, duration, requests per prefill instance, prefill cache
hit rate), writes ``results.json`` and ``compare.png`` to ``--out``, and ends with::

    compare hotspot_throughput_ratio=… hotspot_ttft_p99_ratio=… hotspot_vs_best_stock=…
    cache_pressure_throughput_ratio=… uniform_throughput_ratio=…

(on one line): hotspot and uniform are banaserve over ``stock_cache_aware``;
``hotspot_vs_best_stock`` and cache pressure are banaserve over the best stock system of the
run. ``--quick`` runs stock_cache_aware and banaserve on smaller workloads, in about 5 minutes.
``--repeat N`` runs every workload N times on each started system and reports medians (with
each run's req/s), for ratios that one noisy run cannot settle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from banaserve.cluster.topology import plan_cores  # noqa: E402
from banaserve.router.metrics_parse import parse_sglang_metrics  # noqa: E402
from banaserve.utils.processes import ManagedProcess, exit_on_sigterm, free_port  # noqa: E402

NUM_PREFILL, NUM_DECODE = 2, 1
START_TIMEOUT_S = 900.0
#: The embedded store's RAM: cache pressure's prefixes take about 2.4 GB. The cluster's memory
#: plan (logged at start) shows what the store, pools and processes take of this machine.
STORE_GB = 3
STOCK_POLICIES = ("cache_aware", "round_robin", "power_of_two")


@dataclass(frozen=True)
class Workload:
    name: str
    dataset_args: tuple[str, ...]
    num_prompts: int
    max_concurrency: int
    seed: int  # distinct per workload: one workload's prompts never warm another's cache


def shared_prefix_args(groups: int, per_group: int, prefix_len: int) -> tuple[str, ...]:
    """``generated-shared-prefix``: ``groups`` system prompts, shuffled requests, 4 tokens out."""
    return ("--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups),
            "--gsp-prompts-per-group", str(per_group), "--gsp-system-prompt-len",
            str(prefix_len), "--gsp-question-len", "32", "--gsp-output-len", "4")  # fmt: skip


def workloads(quick: bool) -> list[Workload]:
    n = 32 if quick else 96
    prefix = 512 if quick else 1024
    groups = 16 if quick else 48
    uniform = ("--dataset-name", "random-ids", "--random-input-len", str(prefix),
               "--random-output-len", "4", "--random-range-ratio", "1.0")  # fmt: skip
    return [
        Workload("hotspot", shared_prefix_args(1, n, prefix), n, 32, seed=1),
        Workload("cache_pressure", shared_prefix_args(groups, n // groups, prefix), n, 8, seed=2),
        Workload("uniform", uniform, n // 2, 16, seed=3),
    ]


@dataclass
class Running:
    """A started system: its front URL, its instances by role, and how to stop it."""

    url: str
    prefill_urls: list[str]
    decode_urls: list[str]
    stop: Callable[[], None]


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
    prefill_hit_rate: float = 0.0
    error: str = ""
    #: With ``--repeat``: req/s of every run; the other fields are medians over the runs.
    runs_req_per_s: list[float] = field(default_factory=list)


def instance_args(kv_tokens: int, dtype: str) -> list[str]:
    # --enable-metrics: the per-instance request counts and hit rates come from /metrics.
    return ["--dtype", dtype, "--max-total-tokens", str(kv_tokens), "--page-size", "16",
            "--log-level", "warning", "--enable-metrics"]  # fmt: skip


def banaserve_env() -> dict[str, str]:
    """The environment of BanaServe's processes: the installed package where it has its built
    extension (``--kv-store-mode linker`` needs ``banaserve._C``), else this source tree."""
    probe = [sys.executable, "-c", "import banaserve._C"]
    if subprocess.run(probe, capture_output=True, cwd="/").returncode == 0:
        return dict(os.environ)
    return dict(os.environ, PYTHONPATH=str(REPO / "python"))


@contextmanager
def start_banaserve(
    model: str, out: Path, cores: bool, kv_tokens: int, dtype: str, system: str = "banaserve"
) -> Iterator[Running]:
    port = free_port()
    mode = "linker" if system == "banaserve_linker" else "hicache"
    argv = [
        sys.executable, "-m", "banaserve.launch_server", "--model-path", model,
        "--num-prefill", str(NUM_PREFILL), "--num-decode", str(NUM_DECODE),
        "--port", str(port), "--cluster-log-dir", str(out / system),
        "--kv-store", "embedded", "--kv-store-capacity-gb", str(STORE_GB),
        "--kv-store-mode", mode,
        *instance_args(kv_tokens, dtype), *(["--cpu-affinity"] if cores else []),
    ]  # fmt: skip
    process = ManagedProcess(system, argv, out / system / "gateway.log", env=banaserve_env())
    try:
        url = f"http://127.0.0.1:{port}"
        process.wait_http_ok(f"{url}/health", START_TIMEOUT_S, progress_every=30)
        state = json.loads(urllib.request.urlopen(f"{url}/cluster", timeout=30).read())
        by_role: dict[str, list[str]] = {"prefill": [], "decode": []}
        for instance in state["instances"]:
            by_role[instance["role"]].append(instance["url"])
        yield Running(url, by_role["prefill"], by_role["decode"], process.stop)
    finally:
        process.stop(grace=60)


@contextmanager
def start_stock(
    model: str, policy: str, out: Path, cores: bool, kv_tokens: int, dtype: str
) -> Iterator[Running]:
    from stock_pd import start_stock_pd

    plan = plan_cores(NUM_PREFILL + NUM_DECODE, sorted(os.sched_getaffinity(0))) if cores else None
    log_dir = out / f"stock_{policy}"
    router_args: tuple[str, ...] = ()
    if policy == "power_of_two" and NUM_DECODE < 2:
        # sglang-router's power_of_two needs two workers of a role: one decode gets them all.
        policy, router_args = "round_robin", ("--prefill-policy", "power_of_two")
    with start_stock_pd(
        model, NUM_PREFILL, NUM_DECODE, policy, None, log_dir, plan,
        extra_args=instance_args(kv_tokens, dtype), router_args=router_args,
    ) as pd:  # fmt: skip
        yield Running(pd.url, list(pd.prefill_urls), list(pd.decode_urls), pd.stop)


def scrape(urls: list[str]) -> list[dict[str, float]]:
    out = []
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
                out.append(parse_sglang_metrics(response.read().decode()))
        except OSError:
            out.append({})
    return out


def flush(running: Running) -> None:
    for url in running.prefill_urls + running.decode_urls:
        try:
            urllib.request.urlopen(urllib.request.Request(f"{url}/flush_cache", method="POST"),
                                   timeout=60).read()  # fmt: skip
        except OSError:
            pass


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
        return [Result(**r) for r in json.loads(saved.read_text())]
    out = []
    for path in sorted(folder.glob("*-*.jsonl")):
        system, workload = path.stem.rsplit("-", 1)
        out.append(
            result_from_bench(system, workload, json.loads(path.read_text().splitlines()[-1]))
        )
    return out


def median_result(runs: list[Result]) -> Result:
    """One result for repeated runs of a system on a workload: each measure's median over the
    runs that completed (machines here are noisy); per-instance counts of the median run."""
    done = sorted((r for r in runs if not r.error), key=lambda r: r.req_per_s)
    if not done:
        return runs[-1]
    middle = done[(len(done) - 1) // 2]
    medians = {
        name: statistics.median(getattr(r, name) for r in done)
        for name, kind in Result.__annotations__.items()
        if kind == "float"
    }
    return replace(middle, **medians, runs_req_per_s=[r.req_per_s for r in runs if not r.error])


def run_workload(
    system: str, running: Running, workload: Workload, model: str, out: Path
) -> Result:
    result = Result(system, workload.name)
    flush(running)
    urls = running.prefill_urls + running.decode_urls
    before = scrape(urls)
    result_file = out / f"{system}-{workload.name}.jsonl"
    argv = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
        "--base-url", running.url, "--model", model, "--tokenizer", model,
        "--num-prompts", str(workload.num_prompts), "--max-concurrency",
        str(workload.max_concurrency), "--seed", str(workload.seed),
        "--output-file", str(result_file), "--output-details",
        "--disable-tqdm", *workload.dataset_args,
    ]  # fmt: skip
    print(f"[compare] {system} / {workload.name}: {workload.num_prompts} requests", flush=True)
    # In ``out``: bench_serving drops a results file in its working directory.
    run = subprocess.run(argv, capture_output=True, text=True, timeout=3600, cwd=out)
    with (out / f"{system}-{workload.name}.log").open("a") as log:  # one per repeat
        log.write(run.stdout + run.stderr)
    if run.returncode != 0 or not result_file.exists():
        result.error = (run.stderr or run.stdout)[-500:]
        return result
    data = json.loads(result_file.read_text().splitlines()[-1])
    result = result_from_bench(system, workload.name, data)
    after = scrape(urls)
    if system.startswith("banaserve"):
        with contextlib.suppress(OSError):
            state = urllib.request.urlopen(f"{running.url}/cluster", timeout=30).read()
            (out / f"{system}-{workload.name}-cluster.json").write_bytes(state)

    def delta(name: str, i: int) -> float:
        return after[i].get(name, 0.0) - before[i].get(name, 0.0)

    n = len(running.prefill_urls)
    requests = [int(delta("sglang:num_requests_total", i)) for i in range(len(urls))]
    result.per_prefill, result.per_decode = requests[:n], requests[n:]
    # Instances that compute prompts: stock decode instances receive the KV instead, while
    # BanaServe's compute the prompts they serve directly.
    computing = range(len(urls) if system.startswith("banaserve") else n)
    prompt = sum(delta("sglang:prompt_tokens_total", i) for i in computing)
    cached = sum(delta("sglang:cached_tokens_total", i) for i in computing)
    result.prefill_hit_rate = cached / prompt if prompt else 0.0
    return result


def per_instance(r: Result) -> str:
    """Requests each prefill | each decode instance served, e.g. ``43,43|10``."""
    decode = ",".join(map(str, r.per_decode)) or "?"
    return f"{','.join(map(str, r.per_prefill)) or '?'}|{decode}"


def print_table(results: list[Result]) -> None:
    header = (f"{'system':<20}{'workload':<16}{'req/s':>7}{'out tok/s':>10}{'TTFT p50':>10}"
              f"{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'dur s':>7}  {'requests P|D':<17}"
              "hit")  # fmt: skip
    print(header)
    for r in results:
        if r.error:
            print(f"{r.system:<20}{r.workload:<16}  FAILED: {r.error.splitlines()[-1:]}")
            continue
        print(f"{r.system:<20}{r.workload:<16}{r.req_per_s:>7.2f}{r.output_tok_per_s:>10.1f}"
              f"{r.ttft_p50_ms:>10.0f}{r.ttft_p99_ms:>9.0f}{r.tpot_p50_ms:>10.1f}"
              f"{r.tpot_p99_ms:>8.1f}{r.duration_s:>7.1f}  {per_instance(r):<17}"
              f"{r.prefill_hit_rate:>4.0%}")  # fmt: skip


def plot(results: list[Result], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[compare] matplotlib is not installed: no plot (pip install matplotlib)")
        return
    names = list(dict.fromkeys(r.workload for r in results))
    systems = list(dict.fromkeys(r.system for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        by = {r.workload: r for r in results if r.system == system}
        xs = [i + k * width for i in range(len(names))]
        axes[0].bar(xs, [by[w].req_per_s if w in by else 0 for w in names], width, label=system)
        axes[1].bar(xs, [by[w].ttft_p99_ms / 1000 if w in by else 0 for w in names], width)
    for ax, title in zip(axes, ("throughput (req/s)", "TTFT p99 (s)"), strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"[compare] plot: {path}")


def summary_line(results: list[Result], system: str = "banaserve") -> str:
    """The final line: ``system``'s ratios over the stock systems (see the module docstring);
    a system other than ``banaserve`` is named in the line's first word."""

    def get(system: str, workload: str) -> Result | None:
        return next((r for r in results if r.system == system and r.workload == workload
                     and not r.error), None)  # fmt: skip

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}" if a is not None and b else "nan"

    def best_stock(workload: str) -> float | None:
        rates = [
            r.req_per_s
            for r in results
            if r.workload == workload and r.system.startswith("stock") and not r.error
        ]
        return max(rates) if rates else None  # fmt: skip

    ours = {w: get(system, w) for w in ("hotspot", "cache_pressure", "uniform")}
    base = {w: get("stock_cache_aware", w) for w in ("hotspot", "uniform")}

    def rate(r: Result | None) -> float | None:
        return r.req_per_s if r else None

    hot, hot_base = ours["hotspot"], base["hotspot"]
    label = "compare" if system == "banaserve" else f"compare({system})"
    return (
        f"{label} hotspot_throughput_ratio={ratio(rate(hot), rate(hot_base))} "
        f"hotspot_ttft_p99_ratio="
        f"{ratio(hot.ttft_p99_ms if hot else None, hot_base.ttft_p99_ms if hot_base else None)} "
        f"hotspot_vs_best_stock={ratio(rate(hot), best_stock('hotspot'))} "
        f"cache_pressure_throughput_ratio="
        f"{ratio(rate(ours['cache_pressure']), best_stock('cache_pressure'))} "
        f"uniform_throughput_ratio={ratio(rate(ours['uniform']), rate(base['uniform']))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="2 systems, smaller workloads")
    parser.add_argument("--systems", default=None, help="comma-separated subset of systems")
    parser.add_argument(
        "--workloads", default=None, help="comma-separated subset of hotspot,cache_pressure,uniform"
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin instances to cores")
    parser.add_argument("--kv-tokens", type=int, default=None, help="KV pool of each instance")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="run each workload this many times on each system and report medians",
    )  # fmt: skip
    parser.add_argument(
        "--include", type=Path, nargs="*", default=[],
        help="also report the results of earlier runs in these --out folders (systems this "
        "run does not measure again)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    exit_on_sigterm()  # stop every system's processes on SIGTERM too
    if args.model is None:
        from banaserve.models import default_model_path

        args.model = str(default_model_path())
    out = args.out or REPO / "benchmark" / "results" / time.strftime("compare-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    # Small enough that cache_pressure's prefixes overflow one instance's pool.
    kv_tokens = args.kv_tokens or (6144 if args.quick else 16384)
    systems = ["stock_cache_aware", "banaserve"] if args.quick else [
        *(f"stock_{p}" for p in STOCK_POLICIES), "banaserve"]  # fmt: skip
    if args.systems:
        systems = args.systems.split(",")
        known = {*(f"stock_{p}" for p in STOCK_POLICIES), "banaserve", "banaserve_linker"}
        if set(systems) - known:
            parser.error(f"unknown systems {sorted(set(systems) - known)}; known: {sorted(known)}")
    pin = not args.no_pin
    chosen = workloads(args.quick)
    if args.workloads:
        names = args.workloads.split(",")
        unknown = set(names) - {w.name for w in chosen}
        if unknown:
            parser.error(f"unknown workloads {sorted(unknown)}")
        chosen = [w for w in chosen if w.name in names]
    results: list[Result] = []
    for folder in args.include:
        results += [r for r in results_in(folder) if r.system not in systems]
    started = time.monotonic()
    for system in systems:
        print(f"[compare] starting {system}", flush=True)
        if system.startswith("banaserve"):
            context = start_banaserve(args.model, out, pin, kv_tokens, args.dtype, system)
        else:
            policy = system.removeprefix("stock_")
            context = start_stock(args.model, policy, out, pin, kv_tokens, args.dtype)
        try:
            with context as running:
                for workload in chosen:
                    runs = [run_workload(system, running, workload, args.model, out)
                            for _ in range(args.repeat)]  # fmt: skip
                    results.append(median_result(runs))
        except Exception as exc:  # noqa: BLE001 - one broken system must not sink the others
            print(f"[compare] {system} failed: {exc}", flush=True)
            results += [Result(system, w.name, error=str(exc)) for w in chosen]
        # After every system, so a run stopped early keeps what it measured.
        (out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"\nmodel {args.model} ({args.dtype}), {NUM_PREFILL} prefill + {NUM_DECODE} decode, "
          f"{'pinned' if pin else 'unpinned'}, KV pool {kv_tokens} tokens per instance, "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    print_table(results)
    for r in results:
        if len(r.runs_req_per_s) > 1:
            rates = ", ".join(f"{x:.2f}" for x in r.runs_req_per_s)
            print(f"{r.system} / {r.workload}: req/s of each run {rates} (median above)")
    plot(results, out / "compare.png")
    if any(r.system == "banaserve_linker" for r in results):
        print(summary_line(results, "banaserve_linker"))
    print(summary_line(results))


if __name__ == "__main__":
    main()
