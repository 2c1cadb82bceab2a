"""Attention part of benchmark/gpu_check.sh: CUDA partial attention/merge vs the CPU kernels.

Run after the CUDA build is installed. Without a device it runs the same code on CPU tensors
(a syntax/logic smoke test only). Prints one table row per case and exits 1 on a mismatch.
"""

import sys
import time

import torch

from banaserve import _C
from banaserve.attention import merge_attn_states, merge_many, partial_attention

DEV = "cuda" if (torch.cuda.is_available() and _C.cuda_compiled()) else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # out, vs CPU kernel


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters):
    fn()
    sync()  # warm-up, then the mean of `iters` calls
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def inputs(dtype, tokens, kv_len, q_heads, kv_heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n, h, dim, generator=g).to(dtype)
        for n, h in ((tokens, q_heads), (kv_len, kv_heads), (kv_len, kv_heads))
    ]


failed = False
print(f"{'case':42s} {'max|out-cpu|':>12s} {'max|lse-cpu|':>12s} {'merge3 err':>10s} ok")
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for causal in (False, True):
        # Correctness: CPU kernel (float32 accumulation) as the reference, GQA 32/8, head subset.
        tokens, kv_len, qh, kvh, dim = 64, 1024, 32, 8, 128
        host = inputs(dtype, tokens, kv_len, qh, kvh, dim)
        dev = [x.to(DEV) for x in host]
        kw = {"causal": causal, "kv_head_groups": [5, 0, 3], "token_range": (7, 1000)}
        out_c, lse_c = partial_attention(*host, **kw)
        out_g, lse_g = partial_attention(*dev, **kw)
        # merge of 3 token-range partials, out of order, vs the single call on the device
        parts = [
            partial_attention(*dev, causal=causal, kv_head_groups=[5, 0, 3], token_range=r)
            for r in ((600, 1000), (7, 300), (300, 600))
        ]
        out_m, lse_m = merge_many(parts)
        sync()
        e_out = (out_g.double().cpu() - out_c.double()).abs().max().item()
        e_lse = (lse_g.double().cpu() - lse_c.double()).abs().max().item()
        e_merge = (out_m.double() - out_g.double()).abs().max().item()
        ok = e_out <= TOL[dtype] and e_lse <= 1e-4 and e_merge <= 2 * TOL[dtype]
        failed |= not ok
        name = f"partial {str(dtype)[6:]} causal={causal}"
        print(f"{name:42s} {e_out:12.2e} {e_lse:12.2e} {e_merge:10.2e} {'OK' if ok else 'FAIL'}")

# Timing (no CPU reference: too slow at this size). Prefill-like and decode-like shapes.
print(f"{'timing':42s} {'ms':>9s} {'TFLOP/s':>8s} {'KV GB/s':>8s}")
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for tokens, kv_len, causal in ((1024, 8192, False), (8, 32768, False), (2048, 2048, True)):
        qh, kvh, dim = 32, 8, 128
        q, k, v = (x.to(DEV) for x in inputs(dtype, tokens, kv_len, qh, kvh, dim, seed=1))
        iters = 3 if DEV == "cpu" else 10
        if DEV == "cpu":  # keep the smoke test short
            q, k, v, tokens, kv_len = q[:2], k[:256], v[:256], 2, 256
        s = timed(lambda q=q, k=k, v=v, c=causal: partial_attention(q, k, v, causal=c), iters)
        keys = kv_len * tokens - (tokens * (tokens - 1) // 2 if causal else 0)  # seen per head
        flops = 4.0 * qh * keys * dim
        kv_bytes = 2 * k.numel() * k.element_size()  # K and V once: the floor on traffic
        name = f"partial {str(dtype)[6:]} T={tokens} KV={kv_len} causal={causal}"
        print(f"{name:42s} {s * 1e3:9.3f} {flops / s / 1e12:8.2f} {kv_bytes / s / 1e9:8.1f}")

# Merge throughput (bytes of out_a+out_b+out read/written per second), bf16, large.
out = torch.randn(4096, 32, 128, device=DEV).to(torch.bfloat16)
lse = torch.randn(4096, 32, device=DEV)
s = timed(lambda: merge_attn_states(out, lse, out, lse), 20 if DEV == "cuda" else 2)
moved = 3 * out.numel() * out.element_size() + 3 * lse.numel() * 4
print(f"{'merge bf16 4096x32x128':42s} {s * 1e3:9.3f} {'':8s} {moved / s / 1e9:8.1f}")
# The device's copy bandwidth on the same bytes, same run: the merge's roofline.
src = torch.empty(moved // 2, dtype=torch.uint8, device=DEV)
dst = torch.empty_like(src)
c = timed(lambda: dst.copy_(src), 20 if DEV == "cuda" else 2)
copy_gbps, merge_gbps = 2 * src.numel() / c / 1e9, moved / s / 1e9
print(f"{'device copy (read+write) same bytes':42s} {c * 1e3:9.3f} {'':8s} {copy_gbps:8.1f}")
print(f"merge_fraction_of_copy={merge_gbps / copy_gbps:.2f} (target >= 0.70 on a GPU)")
print(f"attention check on {DEV}: {'FAIL' if failed else 'OK'}")
sys.exit(1 if failed else 0)
