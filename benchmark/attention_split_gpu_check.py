"""Split decode attention, part of benchmark/gpu_check.sh (evidence for attention-level migration).

A decode batch's attention over its KV is split by token range into parts, each computed with
PyTorch's flash kernel that also returns the log-sum-exp, and merged with ``merge_many``
(csrc/attention). It checks the merged output against attention over the whole KV and times
the whole, one part, and the merge: what a hot device keeps, hands away and adds. Llama-3-8B's
head shape (32 query heads, 8 KV heads, 128 dims), bf16. Without a GPU it runs a tiny case on
the CPU kernel (a check of the script, not a measurement).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from banaserve.attention import merge_many

CUDA = torch.cuda.is_available()
HEADS, KV_HEADS, DIM = (32, 8, 128) if CUDA else (4, 2, 16)
CASES = [(64, 8192, 2), (64, 8192, 4), (16, 32768, 2), (128, 2048, 2)] if CUDA else [(2, 64, 2)]


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [bs, kv_heads, group, dim], lse [bs, kv_heads, group]) with the query heads of a
    KV group riding as the query sequence (exact for one new token per sequence)."""
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return out, lse


def rows(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """To merge's layout: ``[tokens, heads, dim]`` and ``[tokens, heads]`` (float32 lse)."""
    bs = out.shape[0]
    return out.reshape(bs, HEADS, DIM), lse.reshape(bs, HEADS).float()


def ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if CUDA:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check(bs: int, ctx: int, parts: int, device: str, dtype: torch.dtype) -> tuple[float, ...]:
    """(whole ms, first part ms, merge ms, max error) of one split."""
    g = torch.Generator(device=device).manual_seed(bs * ctx + parts)
    group = HEADS // KV_HEADS
    q = torch.randn(bs, KV_HEADS, group, DIM, device=device, dtype=dtype, generator=g)
    k = torch.randn(bs, KV_HEADS, ctx, DIM, device=device, dtype=dtype, generator=g)
    v = torch.randn(bs, KV_HEADS, ctx, DIM, device=device, dtype=dtype, generator=g)
    bounds = [ctx * i // parts for i in range(parts + 1)]
    pieces = [(k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    whole, _ = flash(q, k, v)
    partials = [rows(*flash(q, pk, pv)) for pk, pv in pieces]
    merged, _ = merge_many(partials)
    err = (merged.float() - whole.reshape(bs, HEADS, DIM).float()).abs().max().item()
    k0, v0 = pieces[0]
    return (ms(lambda: flash(q, k, v)), ms(lambda: flash(q, k0, v0)),
            ms(lambda: merge_many(partials)), err)  # fmt: skip


def main() -> int:
    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    tol = 2e-2 if CUDA else 1e-5
    ok = True
    print(f"{'bs':>4} {'ctx':>6} {'parts':>5} {'whole ms':>9} {'part ms':>8} {'merge ms':>9}"
          f" {'max err':>9}  ok")  # fmt: skip
    for bs, ctx, parts in CASES:
        t_whole, t_part, t_merge, err = check(bs, ctx, parts, device, dtype)
        ok_case = err <= tol
        ok &= ok_case
        print(f"{bs:>4} {ctx:>6} {parts:>5} {t_whole:9.3f} {t_part:8.3f} {t_merge:9.3f}"
              f" {err:9.2e}  {'OK' if ok_case else 'FAIL'}", flush=True)  # fmt: skip
    print(f"attention split check on {device}: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
