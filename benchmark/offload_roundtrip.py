"""One attention-offload round trip per layer, on this machine's cores (issue 32, item 2).

The hot side (this process, pinned to core 0) sends one layer's decode queries for a batch of
sequences and waits for output and log-sum-exp from a worker pinned to core 1 that holds their
KV. Timed per round trip, for each transport considered:

- ``shm``: BanaServe's channel, a memfd mapping and eventfds, the receiver spinning
  ``SPIN_S`` before it blocks (``banaserve.offload.channel``);
- ``shm_block``: the same, blocking at once (no spin);
- ``socket``: the same messages over a Unix socket pair;
- ``gloo``: ``torch.distributed`` send/recv over gloo (what crosses hosts on the CPU).

Each runs with both cores idle and with both busy (one busy process pinned to each core, as
decode instances would keep them): an echo of the queries (context 0: the transport alone),
and attention over a short and a long context (what the worker's attention adds). Ends with
the busy echo figures: ``offload_roundtrip shm_p50_us=… shm_p99_us=… … gloo_p99_us=…``.

    python benchmark/offload_roundtrip.py [--iters 2000] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from banaserve.offload.client import WorkerProcess, area_bytes_for
from banaserve.offload.compute import decode_attention
from banaserve.offload.pool import PartSpec
from banaserve.utils.processes import free_port, parent_death_signal

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 1  # SmolLM2-135M's head shape; one layer suffices
HOT_CORE, COLD_CORE = 0, 1
TRANSPORTS = ("shm", "shm_block", "socket", "gloo")


def percentiles(times_s: list[float]) -> tuple[float, float]:
    """(p50, p99) in microseconds."""
    ordered = sorted(times_s)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered) * 1e6, p99 * 1e6


@contextmanager
def busy_cores(on: bool) -> Iterator[None]:
    """One busy process pinned to each core while inside, when ``on``."""
    hogs = [] if not on else [
        subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"],
                         preexec_fn=parent_death_signal())
        for core in range(os.cpu_count() or 1)
    ]  # fmt: skip
    try:
        time.sleep(0.5 if on else 0.0)
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def spec(seq: str, tokens: int) -> PartSpec:
    return PartSpec(seq, LAYERS, (0, KV_HEADS), DIM, tokens + 1, HEADS // KV_HEADS)


def time_worker(transport: str, batch: int, tokens: int, iters: int) -> list[float]:
    """Round trips of ``attend`` to a worker process over ``transport`` (``shm``,
    ``shm_block`` or ``socket``), each over ``tokens`` tokens of KV per sequence (0: an echo
    of the queries)."""
    seqs = [f"s{i}" for i in range(batch)]
    area = area_bytes_for(batch, HEADS, KV_HEADS, DIM) + tokens * KV_HEADS * DIM * 8 + (1 << 16)
    spin = {"spin_s": 0.0} if transport == "shm_block" else {}
    worker = WorkerProcess(batch * spec("x", tokens).nbytes + (1 << 20), area, [COLD_CORE],
                           timeout_s=30.0, transport=transport.split("_")[0], **spin)  # fmt: skip
    try:
        client = worker.client
        for seq in seqs if tokens else ():
            client.reserve(spec(seq, tokens))
            kv = torch.randn(KV_HEADS, tokens, DIM)
            client.write(seq, 0, 0, kv, kv)
        q = torch.randn(batch, HEADS, DIM)
        times = []
        for i in range(iters + iters // 10):
            start = time.perf_counter()
            if tokens:
                client.attend(0, seqs, q)
            else:
                client.echo([q])
            if i >= iters // 10:  # the first tenth warms up
                times.append(time.perf_counter() - start)
        return times
    finally:
        worker.stop()


def gloo_worker(port: int, batch: int, tokens: int, iters: int) -> None:
    """Rank 1: answer ``iters`` round trips (and the warm-up) over gloo."""
    import torch.distributed as dist

    os.sched_setaffinity(0, {COLD_CORE})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    k = torch.randn(batch, KV_HEADS, tokens, DIM)
    q = torch.empty(batch, HEADS, DIM)
    for _ in range(iters + iters // 10):
        dist.recv(q, src=0)
        if not tokens:
            dist.send(q, dst=0)
            continue
        answers = [decode_attention(q[i], k[i], k[i]) for i in range(batch)]
        dist.send(torch.stack([a[0] for a in answers]), dst=0)
        dist.send(torch.stack([a[1] for a in answers]), dst=0)
    dist.destroy_process_group()


def time_gloo(batch: int, tokens: int, iters: int) -> list[float]:
    import torch.distributed as dist

    port = free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, "--gloo-worker", str(port), "--batch", str(batch),
         "--tokens", str(tokens), "--iters", str(iters)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=parent_death_signal(),
    )  # fmt: skip
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=2)  # fmt: skip
        q = torch.randn(batch, HEADS, DIM)
        out, lse = torch.empty(batch, HEADS, DIM), torch.empty(batch, HEADS)
        times = []
        for i in range(iters + iters // 10):
            start = time.perf_counter()
            dist.send(q, dst=1)
            dist.recv(out, src=1)
            if tokens:
                dist.recv(lse, src=1)
            if i >= iters // 10:
                times.append(time.perf_counter() - start)
        dist.destroy_process_group()
        return times
    finally:
        child.wait(60)


def measure(transport: str, batch: int, tokens: int, iters: int) -> list[float]:
    if transport == "gloo":
        return time_gloo(batch, tokens, iters)
    return time_worker(transport, batch, tokens, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16, help="short context")
    parser.add_argument("--long-tokens", type=int, default=2048, help="long context")
    parser.add_argument("--gloo-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_worker is not None:
        gloo_worker(args.gloo_worker, args.batch, args.tokens, args.iters)
        return
    os.sched_setaffinity(0, {HOT_CORE})
    torch.set_num_threads(1)
    print(
        f"load average before {os.getloadavg()}; batch {args.batch}, SmolLM2 heads "
        f"{HEADS}/{KV_HEADS}x{DIM}, {args.iters} round trips each (a tenth more warms up)"
    )
    print(f"{'transport':<11}{'cores':<7}{'context':>8}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    busy_short: dict[str, tuple[float, float]] = {}
    for busy in (False, True):
        with busy_cores(busy):
            for tokens in (0, args.tokens, args.long_tokens):
                for transport in TRANSPORTS:
                    iters = args.iters if tokens < args.long_tokens else max(100, args.iters // 10)
                    times = measure(transport, args.batch, tokens, iters)
                    p50, p99 = percentiles(times)
                    mean = statistics.fmean(times) * 1e6
                    print(f"{transport:<11}{'busy' if busy else 'idle':<7}{tokens:>8}"
                          f"{p50:>10.0f}{p99:>10.0f}{mean:>10.0f}", flush=True)  # fmt: skip
                    if busy and tokens == 0:
                        busy_short[transport] = (p50, p99)
    print(f"load average after {os.getloadavg()}")
    figures = [f"{t}_p50_us={p50:.0f} {t}_p99_us={p99:.0f}" for t, (p50, p99) in busy_short.items()]
    print("offload_roundtrip " + " ".join(figures))


if __name__ == "__main__":
    main()
