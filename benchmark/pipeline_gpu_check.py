"""Pipeline part of benchmark/gpu_check.sh: the CUDA layer pipeline's correctness and overlap.

Per layer: fetch a KV-sized block host->device (pinned), compute (matmuls on torch's current
stream, sized so compute takes about as long as one transfer), store the block device->host.
Checks that every stored block equals what compute wrote, then reports, medians of --runs:
compute alone (L*C), transfers alone (L*T), the pipelined total and
overlap_ratio = pipelined / max(L*C, L*T) (target <= 1.05). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from banaserve.pipeline import LayerPipeline


def run(
    layers: int,
    depth: int,
    host_in: list[torch.Tensor],
    host_out: list[torch.Tensor],
    dev: list[torch.Tensor],
    work: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    compute: bool,
    copy: bool,
) -> float:
    fetch = [(host_in[i], dev[i % depth]) for i in range(layers)] if copy else None
    store = [(dev[i % depth], host_out[i]) for i in range(layers)] if copy else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    with LayerPipeline(layers, fetch=fetch, store=store, depth=depth, device="cuda") as p:
        for i in p.layers():
            if compute:
                a, b, c = work
                for _ in range(4):
                    torch.mm(a, b, out=c)
                # Compute writes its layer's block: the stored bytes prove the ordering.
                dev[i % depth].add_(1.0)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--block-mb", type=int, default=64, help="bytes moved per layer each way")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("pipeline gpu check: no CUDA device")
        return 1
    n = args.block_mb << 18  # float32 elements
    host_in = [torch.randn(n).pin_memory() for _ in range(args.layers)]
    host_out = [torch.empty(n).pin_memory() for _ in range(args.layers)]
    dev = [torch.empty(n, device="cuda") for _ in range(args.depth)]

    # Size the matmul so that 4 of them take about one transfer (H2D of one block).
    probe = torch.empty(n, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(8):
        probe.copy_(host_in[i % args.layers], non_blocking=True)
    torch.cuda.synchronize()
    transfer_s = (time.perf_counter() - t0) / 8
    side = 1024
    while True:
        a = torch.randn(side, side, device="cuda") / side
        b = torch.randn(side, side, device="cuda") / side
        c = torch.empty_like(a)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()
        if time.perf_counter() - t0 >= transfer_s or side >= 16384:
            break
        side *= 2 if time.perf_counter() - t0 < transfer_s / 4 else 1.25
        side = int(side) // 64 * 64
    work = (a, b, c)

    run(args.layers, args.depth, host_in, host_out, dev, work, True, True)  # warm-up
    ok = all(torch.equal(host_out[i], host_in[i] + 1.0) for i in range(args.layers))
    modes = {"compute": (True, False), "copy": (False, True), "piped": (True, True)}
    timings: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.runs):
        for mode, (compute, copy) in modes.items():
            elapsed = run(args.layers, args.depth, host_in, host_out, dev, work, compute, copy)
            timings[mode].append(elapsed)
    med = {mode: statistics.median(values) for mode, values in timings.items()}
    limit = max(med["compute"], med["copy"])
    ratio = med["piped"] / limit
    print(f"{'layers':>6} {'block MB':>8} {'L*C ms':>8} {'L*T ms':>8} {'piped ms':>9} ratio")
    print(
        f"{args.layers:>6} {args.block_mb:>8} {med['compute'] * 1e3:8.1f} "
        f"{med['copy'] * 1e3:8.1f} {med['piped'] * 1e3:9.1f} {ratio:.3f}"
    )
    print(f"pipeline data check: {'OK' if ok else 'FAIL'}")
    print(f"pipeline cuda overlap_ratio={ratio:.3f} (target <= 1.05)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
