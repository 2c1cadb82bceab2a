"""Layer profile for the simulator's device model (part of benchmark/gpu_check.sh).

Times one Llama-shaped transformer layer in plain PyTorch (random bf16 weights; the GPU
machine has no SGLang) over a grid of prefill and decode batches, splits each time into the
attention core and the rest (projections, norms, MLP), fits DistServe's per-batch forms

    prefill: a + b * sum(l) + c * sum(l^2)        (l: the prompt lengths of the batch)
    decode:  a + b * sum(ctx) + c * bs            (ctx: the context of each sequence)

and writes every point and the fits as JSON, the file the simulator loads. It also times
pinned host<->device copies (the store's fetch and write path). Without a GPU it runs a tiny
shape on the CPU (a check of the script, not a measurement).

Usage: python benchmark/gpu_layer_profile.py [--out FILE] [--iters N]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerShape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


# Published configurations (config.json of each model); one layer, no tensor parallelism.
SHAPES = {
    "llama3-8b": LayerShape("llama3-8b", 4096, 32, 8, 128, 14336),
    "llama3-70b": LayerShape("llama3-70b", 8192, 64, 8, 128, 28672),
}
SMOKE = LayerShape("smoke", 128, 4, 2, 32, 256)

# Grids: prefill (sequences, prompt length) and decode (batch, context), capped in tokens so
# the KV of one layer stays a few GB and the whole profile fits the GPU check's budget.
PREFILL_GRID = [
    (1, 128),
    (1, 512),
    (1, 1024),
    (1, 2048),
    (1, 4096),
    (1, 8192),
    (4, 256),
    (4, 1024),
    (8, 512),
    (16, 256),
    (2, 4096),
]
DECODE_GRID = [
    (bs, ctx)
    for bs in (1, 8, 32, 64, 128, 256)
    for ctx in (512, 2048, 8192, 32768)
    if bs * ctx <= 2**21
]


class Layer:
    """One Llama decoder layer's weights on ``device``; ``dense``/``attention`` run its parts."""

    def __init__(self, s: LayerShape, device: str, dtype: torch.dtype) -> None:
        g = torch.Generator(device=device).manual_seed(0)

        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, generator=g, device=device) / math.sqrt(k)).to(dtype)

        self.s = s
        self.qkv = w((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden)
        self.o = w(s.hidden, s.heads * s.head_dim)
        self.gate_up = w(2 * s.intermediate, s.hidden)
        self.down = w(s.hidden, s.intermediate)
        self.norm1 = torch.ones(s.hidden, device=device, dtype=dtype)
        self.norm2 = torch.ones(s.hidden, device=device, dtype=dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(x, (self.s.hidden,), self.norm1), self.qkv)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = x + F.linear(attn, self.o)
        gu = F.linear(F.rms_norm(h, (self.s.hidden,), self.norm2), self.gate_up)
        gate, up = gu.chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


def prefill_attention(s: LayerShape, qkv: torch.Tensor, seqs: int, length: int) -> torch.Tensor:
    q, k, v = qkv.view(seqs, length, -1).split(
        [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1
    )
    q = q.view(seqs, length, s.heads, s.head_dim).transpose(1, 2)
    k = k.reshape(seqs, length, s.kv_heads, s.head_dim).transpose(1, 2)
    v = v.reshape(seqs, length, s.kv_heads, s.head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(seqs * length, s.heads * s.head_dim)


def decode_attention(
    s: LayerShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    # The query heads of one KV group ride as a short query sequence: exact for one new token.
    bs = q.shape[0]
    group = s.heads // s.kv_heads
    qg = q.view(bs, s.kv_heads, group, s.head_dim)
    out = F.scaled_dot_product_attention(qg, k, v)
    return out.reshape(bs, s.heads * s.head_dim)


class Timer:
    def __init__(self, device: str, iters: int) -> None:
        self.device, self.iters = device, iters

    def ms(self, fn) -> float:
        """Median milliseconds of ``iters`` calls after two warm-ups."""
        for _ in range(2):
            fn()
        times = []
        for _ in range(self.iters):
            if self.device == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def time_prefill(layer: Layer, timer: Timer, x: torch.Tensor, seqs: int, length: int) -> dict:
    s = layer.s
    qkv = layer.project(x)
    attn = prefill_attention(s, qkv, seqs, length)
    total = timer.ms(lambda: layer.finish(x, prefill_attention(s, layer.project(x), seqs, length)))
    core = timer.ms(lambda: prefill_attention(s, qkv, seqs, length))
    dense = timer.ms(lambda: (layer.project(x), layer.finish(x, attn)))
    return {"seqs": seqs, "len": length, "tokens": seqs * length,
            "layer_ms": total, "attention_ms": core, "dense_ms": dense}  # fmt: skip


def time_decode(layer: Layer, timer: Timer, x: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> dict:  # fmt: skip
    s = layer.s
    bs, ctx = x.shape[0], k.shape[2]
    q = layer.project(x)[:, : s.heads * s.head_dim].contiguous()
    attn = decode_attention(s, q, k, v)

    def whole() -> torch.Tensor:
        qq = layer.project(x)[:, : s.heads * s.head_dim]
        return layer.finish(x, decode_attention(s, qq.contiguous(), k, v))

    core = timer.ms(lambda: decode_attention(s, q, k, v))
    kv_bytes = 2 * k.numel() * k.element_size()
    return {"bs": bs, "ctx": ctx, "sum_ctx": bs * ctx, "layer_ms": timer.ms(whole),
            "attention_ms": core,
            "dense_ms": timer.ms(lambda: (layer.project(x), layer.finish(x, attn))),
            "attention_GBps": kv_bytes / core / 1e6}  # fmt: skip


def profile_prefill(layer: Layer, timer: Timer, grid, device: str, dtype) -> list[dict]:
    rows = []
    for seqs, length in grid:
        x = torch.randn(seqs * length, layer.s.hidden, device=device, dtype=dtype)
        r = time_prefill(layer, timer, x, seqs, length)
        rows.append(r)
        print(f"  prefill {layer.s.name:11} seqs={seqs:3} len={length:5}  layer"
              f" {r['layer_ms']:8.3f} ms  attention {r['attention_ms']:8.3f}"
              f"  dense {r['dense_ms']:8.3f}", flush=True)  # fmt: skip
    return rows


def profile_decode(layer: Layer, timer: Timer, grid, device: str, dtype) -> list[dict]:
    s, rows = layer.s, []
    for bs, ctx in grid:
        x = torch.randn(bs, s.hidden, device=device, dtype=dtype)
        k = torch.randn(bs, s.kv_heads, ctx, s.head_dim, device=device, dtype=dtype)
        r = time_decode(layer, timer, x, k, torch.randn_like(k))
        rows.append(r)
        print(f"  decode  {s.name:11} bs={bs:4} ctx={ctx:6}  layer {r['layer_ms']:8.3f} ms"
              f"  attention {r['attention_ms']:8.3f} ({r['attention_GBps']:7.0f} GB/s)"
              f"  dense {r['dense_ms']:8.3f}", flush=True)  # fmt: skip
    return rows


def least_squares(columns: list[list[float]], y: list[float]) -> list[float]:
    a = torch.tensor(columns, dtype=torch.float64).T
    sol = torch.linalg.lstsq(a, torch.tensor(y, dtype=torch.float64).unsqueeze(1)).solution
    return [float(c) for c in sol.squeeze(1)]


def fit(rows: list[dict], kind: str) -> dict:
    """DistServe's form over per-batch times (ms); the worst relative error says how it holds."""
    if kind == "prefill":
        cols = [
            [1.0] * len(rows),
            [r["tokens"] for r in rows],
            [r["seqs"] * r["len"] ** 2 for r in rows],
        ]
        names = ["a_ms", "b_ms_per_token", "c_ms_per_token2"]
    else:
        cols = [[1.0] * len(rows), [r["sum_ctx"] for r in rows], [r["bs"] for r in rows]]
        names = ["a_ms", "b_ms_per_ctx_token", "c_ms_per_seq"]
    y = [r["layer_ms"] for r in rows]
    coef = least_squares(cols, y)
    pred = [sum(c * col[i] for c, col in zip(coef, cols, strict=True)) for i in range(len(rows))]
    worst = max(abs(p - t) / t for p, t in zip(pred, y, strict=True))
    return {**dict(zip(names, coef, strict=True)), "max_rel_error": worst}


def copy_bandwidth(device: str, timer: Timer, mib: int) -> dict:
    if device != "cuda":
        return {}
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    h2d = timer.ms(lambda: dev.copy_(host, non_blocking=True))
    d2h = timer.ms(lambda: host.copy_(dev, non_blocking=True))
    size = mib << 20
    out = {"bytes": size, "h2d_GBps": size / h2d / 1e6, "d2h_GBps": size / d2h / 1e6}
    print(
        f"  pinned copies of {mib} MiB: host->device {out['h2d_GBps']:.1f} GB/s, "
        f"device->host {out['d2h_GBps']:.1f} GB/s",
        flush=True,
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_layer_profile.json")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = [SHAPES[n] for n in args.shapes.split(",")] if cuda else [SMOKE]
    prefill_grid = PREFILL_GRID if cuda else PREFILL_GRID[:3]
    decode_grid = DECODE_GRID if cuda else [(1, 512), (8, 512), (8, 2048)]
    timer = Timer(device, args.iters if cuda else 2)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke run, not a measurement)",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "method": f"median of {timer.iters} timed calls after 2 warm-ups; CUDA events; one layer",
        "copies": copy_bandwidth(device, timer, 256),
        "models": {},
    }
    for s in shapes:
        layer = Layer(s, device, dtype)
        pre = profile_prefill(layer, timer, prefill_grid, device, dtype)
        dec = profile_decode(layer, timer, decode_grid, device, dtype)
        result["models"][s.name] = {
            "shape": asdict(s),
            "prefill": pre,
            "decode": dec,
            "fit": {"prefill": fit(pre, "prefill"), "decode": fit(dec, "decode")},
        }
        f = result["models"][s.name]["fit"]
        print(f"  fit {s.name}: prefill {json.dumps(f['prefill'])}", flush=True)
        print(f"  fit {s.name}: decode  {json.dumps(f['decode'])}", flush=True)
        del layer
        if cuda:
            torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"  wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
