"""Decode attention over a KV part as the worker answers it: with its log-sum-exp (a part of a
sequence's KV, merged by the caller), or a whole sequence's exactly as SGLang computes it.

One query token per sequence. The GQA query heads that share a KV head ride as that head's
query rows, so the KV is never expanded: ``[kv_heads, q_per_kv, head_dim]`` queries against
``[kv_heads, tokens, head_dim]`` keys, through the CPU flash kernel that returns the
log-sum-exp too (FACTS.md: bit-identical output to ``F.scaled_dot_product_attention``, 5-8x
faster than this project's own partial attention for decode).
"""

from __future__ import annotations

import torch


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one token's query heads ``q`` (``[heads, head_dim]``, head ``h`` reading
    KV head ``h // (heads // kv_heads)``) over ``k``/``v`` (``[kv_heads, tokens, head_dim]``):
    ``(out [heads, head_dim], lse [heads] float32)``, natural-log log-sum-exp of the scaled
    scores. Over no tokens: ``out`` 0 and ``lse`` -inf (what :func:`merge_attn_states` reads
    as an empty side). New tensors, owned by the caller."""
    heads, dim = q.shape
    kv_heads, tokens, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} KV heads")
    if tokens == 0:
        return torch.zeros_like(q), torch.full((heads,), float("-inf"))
    rows = q.reshape(1, kv_heads, heads // kv_heads, dim)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        rows, k.unsqueeze(0), v.unsqueeze(0), scale=scale
    )[:2]
    return out.reshape(heads, dim), lse.reshape(heads).float()


def whole_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """A whole sequence's decode attention, bit for bit what SGLang's torch-native backend
    computes (``_run_sdpa_forward_decode``: one ``scaled_dot_product_attention`` call per
    sequence, GQA left to the call): ``q`` ``[heads, head_dim]``, ``k``/``v`` ``[kv_heads,
    tokens, head_dim]``; ``out [heads, head_dim]``, a new tensor. Folding a KV head's query
    heads into rows, as :func:`decode_attention` does, sums in another order (measured here:
    up to 3e-7 apart in fp32), so a sequence split uses this call and no LSE."""
    heads, kv_heads = q.shape[0], k.shape[0]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0).unsqueeze(2), k.unsqueeze(0), v.unsqueeze(0),
        scale=scale, enable_gqa=heads != kv_heads,
    )  # fmt: skip
    return out.reshape(heads, q.shape[1])
