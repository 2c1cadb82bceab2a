"""What a two-stage split costs on this machine: the layer controller's ``split_cost``.

``--migration layer`` runs a decode instance as SGLang's two-stage pipeline so that its later
layers can run on a second core. This measures, on the same model and flags, one plain
instance on one core against one two-stage instance (``--pp-size 2 --pp-min-boundary 1``,
stage 0 on core 0, stage 1 on core 1) at k = L (stage 1 runs no layer: what layer mode costs
before anything moves) and at k = L/2 (half the layers on each core):

- ``single``: ms per output token of one request alone (64 tokens, median of 3);
- ``batch``: ms per decode step with ``--batch`` requests decoding together;
- ``prefill``: seconds to first token of a fresh 1024-token prompt (median of 3).

Every prompt is fresh token ids, so no measurement hits a cache. ``--repeat`` whole runs; each
figure is the median over runs. The last line:
``pp_cost batch_at_L=… batch_at_half=… single_at_L=… single_at_half=… split_cost=…``: step
times over the plain instance's, and ``split_cost`` = 2 x (batch step at L/2) / (plain batch
step): the core-seconds a split instance's work takes over what it takes whole, as the layer
controller counts it (each core holds half the layers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from banaserve.utils.processes import ManagedProcess, free_port
from sglang_launch import CPU_SERVER_ARGS, generate, server_env

DEFAULT_MODEL = Path.home() / ".cache/banaserve/models/SmolLM2-135M-Instruct"
OUTPUT_TOKENS = 64
PROMPT_TOKENS = 32
PREFILL_TOKENS = 1024


class Prompts:
    """Fresh token ids for every request (one seed: the same ids for every system)."""

    def __init__(self, seed: int = 11) -> None:
        self.rng = random.Random(seed)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 40000) for _ in range(n)]


def timed(url: str, ids: list[int], max_new_tokens: int) -> float:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    generate(url, {"input_ids": ids, "sampling_params": params}, timeout=600)
    return time.perf_counter() - start


def measure(url: str, prompts: Prompts, batch: int) -> dict[str, float]:
    """Per output token of one request (ms), per decode step of ``batch`` (ms), and one
    1024-token prefill (s) on the server at ``url``."""
    timed(url, prompts.ids(PROMPT_TOKENS), 8)  # warm-up
    single = statistics.median(
        timed(url, prompts.ids(PROMPT_TOKENS), OUTPUT_TOKENS) / OUTPUT_TOKENS for _ in range(3)
    )
    batch_ids = [prompts.ids(PROMPT_TOKENS) for _ in range(batch)]
    with ThreadPoolExecutor(batch) as pool:
        start = time.perf_counter()
        list(pool.map(lambda ids: timed(url, ids, OUTPUT_TOKENS), batch_ids))
        step = (time.perf_counter() - start) / OUTPUT_TOKENS
    prefill = statistics.median(timed(url, prompts.ids(PREFILL_TOKENS), 1) for _ in range(3))
    return {"single": single * 1e3, "batch": step * 1e3, "prefill": prefill}


def start(
    name: str, model: Path, cores: str, flags: list[str], out: Path
) -> tuple[str, ManagedProcess]:
    port = free_port()
    argv = ["taskset", "-c", cores, sys.executable, "-m", "banaserve.launch_server",
            "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
            *CPU_SERVER_ARGS, *flags]  # fmt: skip
    env = server_env(tuple(int(c) for c in cores.split(",")))
    env["OMP_NUM_THREADS"] = "1"  # one thread per stage process, as in a pinned cluster
    process = ManagedProcess(name, argv, out / f"{name}.log", env=env)
    url = f"http://127.0.0.1:{port}"
    process.wait_http_ok(f"{url}/health", 300.0, 30.0)
    return url, process


def move(url: str, boundary: int) -> None:
    request = urllib.request.Request(f"{url}/pp_boundary", data=json.dumps(
        {"boundary": boundary}).encode(), headers={"Content-Type": "application/json"})  # fmt: skip
    urllib.request.urlopen(request, timeout=30).read()
    timed(url, [101, 102, 103], 2)  # the next micro-batch applies it


def one_run(model: Path, layers: int, batch: int, out: Path, prompts: Prompts) -> dict:
    rows = {}
    url, process = start("plain", model, "0", [], out)
    try:
        rows["plain"] = measure(url, prompts, batch)
    finally:
        process.stop()
    flags = ["--pp-size", "2", "--pp-layer-boundary", str(layers), "--pp-min-boundary", "1"]
    url, process = start("split", model, "0,1", flags, out)
    try:
        rows["split_at_L"] = measure(url, prompts, batch)
        move(url, layers // 2)
        rows["split_at_half"] = measure(url, prompts, batch)
    finally:
        process.stop()
    for name, row in rows.items():
        print(f"[pp_cost] {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()),
              flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmark/results/pp_cost"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    layers = json.loads((args.model / "config.json").read_text())["num_hidden_layers"]
    load_before = os.getloadavg()
    prompts = Prompts()
    runs = [one_run(args.model, layers, args.batch, args.out, prompts) for _ in range(args.repeat)]
    median = {
        name: {key: statistics.median(run[name][key] for run in runs) for key in runs[0][name]}
        for name in runs[0]
    }
    load_after = os.getloadavg()
    print(f"\n{args.model.name}, batch {args.batch}, {args.repeat} runs (medians); load average "
          f"before {' '.join(f'{x:.2f}' for x in load_before)}, after "
          f"{' '.join(f'{x:.2f}' for x in load_after)}")  # fmt: skip
    print(f"{'system':16} {'single ms/tok':>14} {'batch ms/step':>14} {'prefill s':>10}")
    for name, row in median.items():
        print(f"{name:16} {row['single']:14.0f} {row['batch']:14.0f} {row['prefill']:10.2f}")
    plain = median["plain"]
    at_l, half = median["split_at_L"], median["split_at_half"]
    print(
        f"pp_cost batch_at_L={at_l['batch'] / plain['batch']:.2f} "
        f"batch_at_half={half['batch'] / plain['batch']:.2f} "
        f"single_at_L={at_l['single'] / plain['single']:.2f} "
        f"single_at_half={half['single'] / plain['single']:.2f} "
        f"split_cost={2 * half['batch'] / plain['batch']:.2f}"
    )


if __name__ == "__main__":
    main()
