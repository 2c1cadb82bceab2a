"""One attention offload round trip per layer, on a GPU host (evidence for issue 32).

Attention-level migration sends each layer's queries of the offloaded part away and waits for
the partial output and its log-sum-exp. On one GPU the nearest cold device is the host: this
times, per decode batch size, the round trip of a layer's queries (device to pinned host) and
answer (output and LSE back), synchronised as a decode step would be, and the host CPU's
attention over a part of the KV against the GPU's over the same part. Llama-3-8B's head shape
(32 query heads, 8 KV heads, 128 dims), bf16 on the GPU, float32 on the host. Median and p99
of many runs. Without a GPU it runs a tiny case on the CPU (a check of the script only).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

CUDA = torch.cuda.is_available()
HEADS, KV_HEADS, DIM = 32, 8, 128
BATCHES = (1, 8, 32, 128) if CUDA else (1, 2)
PART_CTX = (1024, 4096) if CUDA else (64,)
ITERS = 300 if CUDA else 5


def percentiles(times_ms: list[float]) -> tuple[float, float]:
    ordered = sorted(times_ms)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def round_trip(bs: int) -> tuple[float, float]:
    """(p50, p99) ms: queries to the host and the answer back, each step synchronised."""
    device = "cuda" if CUDA else "cpu"
    q = torch.randn(bs, HEADS, DIM, device=device, dtype=torch.bfloat16)
    answer = torch.randn(bs, HEADS, DIM + 2, dtype=torch.bfloat16).pin_memory() if CUDA else (
        torch.randn(bs, HEADS, DIM + 2, dtype=torch.bfloat16))  # fmt: skip
    q_host = torch.empty(q.shape, dtype=q.dtype, pin_memory=CUDA)
    back = torch.empty(answer.shape, dtype=answer.dtype, device=device)
    times = []
    for i in range(ITERS + 10):
        t0 = time.perf_counter()
        q_host.copy_(q, non_blocking=True)
        if CUDA:
            torch.cuda.current_stream().synchronize()  # the host needs the queries
        back.copy_(answer, non_blocking=True)
        if CUDA:
            torch.cuda.current_stream().synchronize()  # the next layer needs the answer
        if i >= 10:
            times.append((time.perf_counter() - t0) * 1e3)
    return percentiles(times)


def attention_ms(bs: int, ctx: int, device: str, dtype: torch.dtype) -> float:
    """Median ms of decode attention over ``ctx`` tokens of KV for ``bs`` sequences."""
    group = HEADS // KV_HEADS
    q = torch.randn(bs, KV_HEADS, group, DIM, device=device, dtype=dtype)
    k = torch.randn(bs, KV_HEADS, ctx, DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    times = []
    for i in range(min(ITERS, 30) + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    print(f"host threads {torch.get_num_threads()}; device {'cuda' if CUDA else 'cpu (smoke)'}")
    print(f"{'bs':>4} {'rt p50 ms':>10} {'rt p99 ms':>10}")
    for bs in BATCHES:
        p50, p99 = round_trip(bs)
        print(f"{bs:>4} {p50:10.3f} {p99:10.3f}", flush=True)
    print(f"{'bs':>4} {'ctx':>6} {'gpu ms':>8} {'host ms':>8}")
    for bs in BATCHES:
        for ctx in PART_CTX:
            gpu = attention_ms(bs, ctx, "cuda", torch.bfloat16) if CUDA else float("nan")
            host = attention_ms(bs, ctx, "cpu", torch.float32)
            print(f"{bs:>4} {ctx:>6} {gpu:8.3f} {host:8.3f}", flush=True)
    print("offload round trip check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
