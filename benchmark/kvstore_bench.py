"""KV store throughput and latency per transport, against memcpy in the same run.

Usage: ``python benchmark/kvstore_bench.py [--quick]``

Starts its own store server (``python -m banaserve.kvstore.server --port 0``), and for each page
size (64 KiB, 256 KiB, 1 MiB, 4 MiB) and transport (tcp://, shm://, ucx:// when ucxx imports)
measures batched put and get throughput (one call moves ``--batch-mb`` MiB; median over
repetitions), the same bytes copied page by page with ``np.copyto`` into preallocated arrays
(median), and the p50/p99 latency of a one-page get. Gets are zero-copy on the client side:
the destinations are preallocated numpy arrays handed to ``KvStoreClient.get``.

The last line, quoted by issues, is the transport with the best 1 MiB get/memcpy ratio::

    kvstore transport=<t> page=1MiB get_GBps=<x.xx> memcpy_GBps=<y.yy> ratio=<x/y>
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

from banaserve.kvstore.client import KvStoreClient  # noqa: E402
from banaserve.kvstore.transport import KvStoreError  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
PAGE_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
START_TIMEOUT_S = 30.0


def fmt_size(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB"


class StoreServer:
    """The store server as a child process in its own session; stopped by PID."""

    def __init__(self, capacity_gb: float, ucx: bool) -> None:
        env = dict(os.environ)
        env.pop("BANASERVE_KV_STORE_TOKEN", None)
        path = [str(REPO / "python"), env.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        argv = [sys.executable, "-m", "banaserve.kvstore.server", "--port", "0"]
        argv += ["--capacity-gb", str(capacity_gb), "--log-level", "warning"]
        if ucx:
            # ucxx listens on every interface whatever --host says; the store refuses that
            # unless told: acceptable for a benchmark on loopback with nothing stored.
            argv += ["--ucx-port", "0", "--insecure"]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,
        )
        try:
            assert self.proc.stdout is not None
            ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
            line = self.proc.stdout.readline() if ready else ""
            match = re.search(r"listening on tcp://([^\s,;]+)", line)
            if not match:
                raise RuntimeError(f"store server did not start (first line {line!r})")
            self.endpoint = match.group(1)
            ucx_match = re.search(r"ucx://([^\s,;)]+)", line)
            self.ucx_endpoint = ucx_match.group(1) if ucx_match else None
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass
class Row:
    transport: str
    page: int
    put_gbps: float
    get_gbps: float
    memcpy_gbps: float
    p50_us: float
    p99_us: float

    @property
    def ratio(self) -> float:
        return self.get_gbps / self.memcpy_gbps


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def percentile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def bench_one(
    client: KvStoreClient, transport: str, page: int, batch: int, reps: int, lat_reps: int
) -> Row:
    n = max(1, batch // page)
    nbytes = n * page
    rng = np.random.default_rng(page)
    sources = [rng.integers(0, 256, page, dtype=np.uint8) for _ in range(n)]
    dests = [np.empty(page, dtype=np.uint8) for _ in range(n)]
    keys = [hashlib.sha256(f"{transport}/{page}/{i}".encode()).digest() for i in range(n)]

    def put() -> None:
        if not all(client.put(keys, sources)):
            raise RuntimeError(f"{transport}: put of {n}x{fmt_size(page)} not stored")

    def get() -> None:
        if not all(client.get(keys, dests)):
            raise RuntimeError(f"{transport}: get of {n}x{fmt_size(page)} missed")

    def memcpy() -> None:
        for d, s in zip(dests, sources, strict=True):
            np.copyto(d, s)

    put()  # warm: connection, shm segment size, store
    get()
    for d, s in zip(dests, sources, strict=True):
        if not np.array_equal(d, s):
            raise RuntimeError(f"{transport}: get returned wrong bytes for {fmt_size(page)}")
    memcpy()
    put_s = median_seconds(put, reps)
    get_s = median_seconds(get, reps)
    memcpy_s = median_seconds(memcpy, reps)

    one_key, one_dest = keys[:1], dests[:1]
    lat = []
    for _ in range(lat_reps):
        t0 = time.perf_counter()
        client.get(one_key, one_dest)
        lat.append(time.perf_counter() - t0)
    lat.sort()
    return Row(
        transport,
        page,
        nbytes / put_s / 1e9,
        nbytes / get_s / 1e9,
        nbytes / memcpy_s / 1e9,
        percentile(lat, 0.50) * 1e6,
        percentile(lat, 0.99) * 1e6,
    )


def ucx_unavailable() -> str | None:
    # find_spec, not import: importing ucxx loads libucx, which reads its environment then,
    # before the transport has set its defaults.
    if importlib.util.find_spec("ucxx") is None:
        return "skipped: ucxx not installed"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 1 minute)")
    parser.add_argument("--batch-mb", type=int, default=None, help="MiB per put/get call")
    parser.add_argument("--reps", type=int, default=None, help="throughput repetitions")
    parser.add_argument("--lat-reps", type=int, default=None, help="one-page get repetitions")
    parser.add_argument("--transports", default="tcp,shm,ucx", help="comma-separated")
    args = parser.parse_args()
    batch = (args.batch_mb or (32 if args.quick else 64)) * MiB
    reps = args.reps or (5 if args.quick else 11)
    lat_reps = args.lat_reps or (200 if args.quick else 1000)
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]

    print(
        f"kvstore_bench: batch {batch // MiB} MiB per call, {reps} reps (median), "
        f"{lat_reps} one-page gets; pid {os.getpid()}, {os.cpu_count()} CPUs",
        flush=True,
    )
    server = StoreServer(
        capacity_gb=max(1.0, 2.5 * len(PAGE_SIZES) * batch * 2 / (1 << 30)),
        ucx="ucx" in transports and ucx_unavailable() is None,
    )
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    header = (
        f"{'transport':<9} {'page':>6} {'put GB/s':>9} {'get GB/s':>9} {'memcpy GB/s':>11} "
        f"{'get/memcpy':>10} {'p50 us':>8} {'p99 us':>8}"
    )
    try:
        print(header)
        print("-" * len(header), flush=True)
        for transport in transports:
            if transport == "ucx" and (why := ucx_unavailable()) is not None:
                skipped[transport] = why
                print(f"{'ucx':<9} {why}", flush=True)
                continue
            try:
                endpoint = server.ucx_endpoint if transport == "ucx" else server.endpoint
                client = KvStoreClient(f"{transport}://{endpoint}", timeout=60.0)
            except KvStoreError as exc:
                skipped[transport] = f"skipped: {exc}"
                print(f"{transport:<9} skipped: {exc}", flush=True)
                continue
            try:
                for page in PAGE_SIZES:
                    row = bench_one(client, transport, page, batch, reps, lat_reps)
                    rows.append(row)
                    print(
                        f"{transport:<9} {fmt_size(page):>6} {row.put_gbps:>9.2f} "
                        f"{row.get_gbps:>9.2f} {row.memcpy_gbps:>11.2f} {row.ratio:>10.2f} "
                        f"{row.p50_us:>8.0f} {row.p99_us:>8.0f}",
                        flush=True,
                    )
            finally:
                client.close()
    finally:
        server.stop()

    at_1mib = [r for r in rows if r.page == MiB]
    if not at_1mib:
        print("kvstore transport=none page=1MiB get_GBps=0.00 memcpy_GBps=0.00 ratio=0.00")
        return 1
    best = max(at_1mib, key=lambda r: r.ratio)
    print(
        f"kvstore transport={best.transport} page=1MiB get_GBps={best.get_gbps:.2f} "
        f"memcpy_GBps={best.memcpy_gbps:.2f} ratio={best.ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
