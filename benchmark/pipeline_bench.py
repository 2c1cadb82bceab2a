"""How well the layer pipeline hides transfers behind compute (banaserve.pipeline, CPU path).

Per layer, compute takes C (a sleep in the compute callback by default: on a GPU the host is idle
while the device computes) and each transfer takes T (a copy paced to T by the C++ copier, or a
plain memcpy whose size is calibrated to take T). For L layers:

- limit     = L * max(C, T): no pipeline can beat it (fetch, compute and store each need
              L stage-times on their own resource). C and T here are the *measured* per-layer
              means of the compute and copy stages (from the pipeline's own timestamps) of the
              same run, so sleep overshoot is not counted as pipeline overhead.
- serial    = the same layers with depth=1, where each layer is fetched, computed and stored
              before the next starts (measured); about L * (C + 2T).
- pipelined = wall time of the pipelined run (construction to close, depth --depth).
- overlap_ratio = pipelined / limit (1.0 is perfect; fill and drain add about 2T / (L * max)).

Each cell is the median of --runs runs. The last line is the one CI greps:
``pipeline T/C=1 overlap_ratio=<ratio>``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from banaserve.pipeline import LayerPipeline

RATIOS = (0.1, 0.5, 1.0, 2.0)
#: Paced mode copies this much per layer: small, so the memcpy itself is a sliver of T.
PACED_BYTES = 256 << 10


def calibrate_memcpy_bytes(target_s: float) -> int:
    """Bytes that one memcpy (numpy copyto, like the C++ memcpy) moves in about target_s."""
    n = 8 << 20
    a, b = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    rate = n / min(times)
    return max(4096, int(rate * target_s) // 4096 * 4096)


def compute_fn(kind: str, seconds: float):
    if kind == "sleep":
        return lambda: time.sleep(seconds)

    def busy() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    return busy


def run_once(
    layers: int, nbytes: int, depth: int, rate: float, compute
) -> tuple[float, float, float]:
    """One pass; returns (wall s, mean compute s, mean copy s per layer) from its timestamps.

    Means, not medians: L * mean is the total time the stage really took, so L * max(means)
    is a true lower bound even when the machine adds the odd slow layer."""
    host = [np.full(nbytes, i + 1, np.uint8) for i in range(layers)]
    # np.full touches every page now: page faults in the copies would be CPU work that a DMA
    # engine does not do, and on a small machine they steal the core the compute loop runs on.
    dev = [np.full(nbytes, 0, np.uint8) for _ in range(depth)]
    out = [np.full(nbytes, 0, np.uint8) for _ in range(layers)]
    start = time.perf_counter()
    with LayerPipeline(
        layers,
        fetch=[(host[i], dev[i % depth]) for i in range(layers)],
        store=[(dev[i % depth], out[i]) for i in range(layers)],
        depth=depth,
        bytes_per_second=rate,
    ) as p:
        for _ in p.layers():
            compute()
    wall = time.perf_counter() - start
    ts = p.timestamps().astype(np.float64) * 1e-9
    dur = ts[:, :, 1] - ts[:, :, 0]
    copy = max(float(dur[:, 0].mean()), float(dur[:, 2].mean()))
    return wall, float(dur[:, 1].mean()), copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--compute-ms", type=float, default=2.0, help="per-layer compute C")
    ap.add_argument("--compute", choices=("sleep", "busy"), default="sleep")
    ap.add_argument(
        "--copy",
        choices=("paced", "memcpy"),
        default="paced",
        help="paced: 256 KiB copies paced to T (models a DMA engine); memcpy: sized to take T "
        "(CPU-bound copies: on a small machine they compete with compute for cores)",
    )
    ap.add_argument("--depth", type=int, default=4, help="ring depth (3 = no slack)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    c = args.compute_ms * 1e-3
    compute = compute_fn(args.compute, c)
    print(
        f"layers={args.layers} C={args.compute_ms} ms compute={args.compute} copy={args.copy} "
        f"depth={args.depth} runs={args.runs} (medians)"
    )
    header = (
        f"{'T/C':>5} {'C ms':>6} {'T ms':>6} {'limit ms':>9} {'serial ms':>10} "
        f"{'L(C+2T) ms':>10} {'piped ms':>9} {'ratio':>6} {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    ratio_at_1 = float("nan")
    for r in RATIOS:
        t = r * c
        if args.copy == "paced":
            nbytes, rate = PACED_BYTES, PACED_BYTES / t
        else:
            nbytes, rate = calibrate_memcpy_bytes(t), 0.0
        run_once(args.layers, nbytes, args.depth, rate, compute)  # warm-up
        piped, limits, cs, ts = [], [], [], []
        serial = []
        for _ in range(args.runs):
            wall, cm, tm = run_once(args.layers, nbytes, args.depth, rate, compute)
            piped.append(wall)
            limits.append(args.layers * max(cm, tm))
            cs.append(cm)
            ts.append(tm)
            serial.append(run_once(args.layers, nbytes, 1, rate, compute)[0])
        ratios = [p / lim for p, lim in zip(piped, limits, strict=True)]
        med = statistics.median
        ratio = med(ratios)
        if r == 1.0:
            ratio_at_1 = ratio
        formula = args.layers * (med(cs) + 2 * med(ts))
        print(
            f"{r:>5} {med(cs) * 1e3:>6.2f} {med(ts) * 1e3:>6.2f} {med(limits) * 1e3:>9.1f} "
            f"{med(serial) * 1e3:>10.1f} {formula * 1e3:>10.1f} {med(piped) * 1e3:>9.1f} "
            f"{ratio:>6.3f} {med(serial) / med(piped):>6.2f}x"
        )
    print(f"pipeline T/C=1 overlap_ratio={ratio_at_1:.3f}")


if __name__ == "__main__":
    main()
