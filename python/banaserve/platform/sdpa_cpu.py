"""Extend attention in SGLang's torch-native attention backend, the one the CPU uses.

**New rows only.** For a request that extends a cached prefix (a radix-cache or KV-store hit),
``TorchNativeAttnBackend._run_sdpa_forward_extend`` runs attention over the whole sequence:
it allocates a query of the full length with ``torch.empty``, fills only the new tokens' rows
and throws the prefix rows' outputs away. For a 32-token question after a 1,024-token cached
prompt that is 33 times the attention work needed, about 80% of such a request's compute
here. :func:`extend_new_rows` computes the new rows only.

Greedy output must not depend on what was cached, so a row's attention must come out bit for
bit the same whether its prefix was cached or not. CPU attention kernels give a row the same
bits whatever the other rows of the call hold, but not whatever the call's *shape* is (a
one-row matrix product sums in another order than a many-row one). So rows go to the kernel
in chunks of :data:`ROW_CHUNK` aligned to absolute positions: the chunk holding position
``r`` of a sequence is ``[r - r % ROW_CHUNK, min(that + ROW_CHUNK, length))`` and attends
keys ``0 .. chunk end`` under the causal mask, cached or not; rows of a chunk that belong to
the cached prefix are zeros, and their outputs are dropped. Paths this does not cover
(non-causal, sliding window, encoder tokens) keep SGLang's.

**Zeroed scratch.** In those paths the prefix rows hold whatever the allocator's memory held
before, often denormal floats, and CPU arithmetic on denormals is about 90 times slower
(measured here: 1.4 s instead of 16 ms per layer for 1,060 tokens of SmolLM2-135M, so one
store-loaded request took 16 s on a shared core instead of half a second).

The module's ``torch.empty`` and ``torch.empty_like`` become ``torch.zeros`` and
``torch.zeros_like``: the shapes do not change, so the rows that are kept are bit for bit what
they were; the other ``empty`` buffers there are outputs that are overwritten in full.

Both are applied by the import hook right after
``sglang.srt.layers.attention.torch_native_backend`` executes, on the CPU platform only.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from banaserve.platform.module_view import view_torch_of

#: Query rows per attention call. At most 31 prefix rows are computed for nothing (with
#: 16-token pages, 16); a 1,024-token prompt with nothing cached takes 32 calls per layer.
ROW_CHUNK = 32


def patch_torch_native_backend(module: types.ModuleType) -> None:
    import torch

    view_torch_of(module, empty=torch.zeros, empty_like=torch.zeros_like)
    backend = module.TorchNativeAttnBackend
    backend._run_sdpa_forward_extend = extend_new_rows(backend._run_sdpa_forward_extend)


def extend_new_rows(original: Callable[..., Any]) -> Callable[..., Any]:
    """``TorchNativeAttnBackend._run_sdpa_forward_extend`` computing only the new rows (see
    the module doc); ``original`` serves the paths it does not cover. Same signature and
    contract: fills ``output`` ([num_new_tokens, heads, head_dim]) and returns it."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    @functools.wraps(original)
    def run_sdpa_forward_extend(
        self: Any,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_prefix_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None = None,
        scaling: float | None = None,
        enable_gqa: bool = False,
        causal: bool = False,
        is_cross_attn: bool = False,
        sliding_window_size: int | None = None,
    ) -> torch.Tensor:
        windowed = sliding_window_size is not None and sliding_window_size > -1
        if not causal or windowed or encoder_lens is not None or is_cross_attn:
            return original(
                self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens, scaling,
                enable_gqa, causal, is_cross_attn, sliding_window_size,
            )  # fmt: skip
        start = 0
        for seq, (length, new) in enumerate(
            zip(seq_lens.tolist(), extend_seq_lens.tolist(), strict=True)
        ):
            tokens = req_to_token[req_pool_indices[seq], :length]
            keys = k_cache[tokens].movedim(0, 1).to(query.dtype)  # [kv_heads, length, dim]
            values = v_cache[tokens].movedim(0, 1).to(query.dtype)
            prefix = length - new
            for first in range(prefix - prefix % ROW_CHUNK, length, ROW_CHUNK):
                last = min(first + ROW_CHUNK, length)
                skip = max(prefix - first, 0)  # cached rows at the chunk's start
                new_rows = slice(start + first + skip - prefix, start + last - prefix)
                rows = query.new_zeros(query.shape[1], last - first, query.shape[2])
                rows[:, skip:] = query[new_rows].movedim(0, 1)
                # Row i (position first + i) sees keys 0 .. first + i.
                mask = torch.ones(last - first, last, dtype=torch.bool, device=query.device)
                out = scaled_dot_product_attention(
                    rows.unsqueeze(0), keys[:, :last].unsqueeze(0),
                    values[:, :last].unsqueeze(0), attn_mask=mask.tril(first),
                    scale=scaling, enable_gqa=enable_gqa,
                )  # fmt: skip
                output[new_rows] = out.squeeze(0)[:, skip:].movedim(0, 1)
            start += new
        return output

    return run_sdpa_forward_extend


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.layers.attention.torch_native_backend": patch_torch_native_backend,
}
