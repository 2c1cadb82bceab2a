"""Partial attention over a token range and/or a subset of KV-head groups, with its log-sum-exp.

Attention-level migration computes attention over the part of the KV a side holds (a token
range, or whole GQA groups of heads); the token-range partials recombine exactly with
`merge_attn_states` / `merge_many`, the head-group partials by concatenating along the head axis.

torch is not imported with this module: a tensor can only arrive if the caller imported torch.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from banaserve import _C
from banaserve.attention._cuda import launch_target, require_cuda_build, scalar_type

if TYPE_CHECKING:
    import torch

    Array = TypeVar("Array", np.ndarray, torch.Tensor)
else:
    Array = TypeVar("Array")

__all__ = ["partial_attention"]


def partial_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    token_range: tuple[int, int] | None = None,
    kv_head_groups: Sequence[int] | None = None,
    causal: bool = False,
    q_positions: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    kv_offset: int = 0,
    scale: float | None = None,
) -> tuple[Array, Array]:
    """Softmax attention of ``q`` over part of ``k``/``v``, with the log-sum-exp of the scores.

    Shapes (GQA: ``q_heads = kv_heads * group``; query head ``h`` reads KV head ``h // group``)::

        q     [tokens, q_heads, head_dim]
        k, v  [kv_len, kv_heads, head_dim]
        out   [tokens, len(kv_head_groups) * group, head_dim]   (all q_heads without a subset)
        lse   [tokens, len(kv_head_groups) * group]

    Args:
        q, k, v: one kind and dtype. numpy: float16, float32 or float64. torch CPU: those or
            bfloat16. torch CUDA: float32, float16 or bfloat16 (head_dim <= 512).
        token_range: ``(start, stop)``: only keys ``k[start:stop]`` are read,
            ``0 <= start <= stop <= kv_len``. None: all keys.
        kv_head_groups: KV-head indices (distinct, any order); each brings its whole group of
            query heads, so output head ``i * group + r`` is query head
            ``kv_head_groups[i] * group + r``. None: every KV head in order.
        causal: mask by absolute position: key ``k[j]`` sits at position ``kv_offset + j``, and a
            query at position ``p`` sees keys at positions ``<= p``.
        q_positions: ``[tokens]`` integer absolute positions of the queries, read only when
            causal. None: the queries are the last ``tokens`` positions of the sequence,
            ``kv_offset + kv_len - tokens + arange(tokens)`` (prefill/decode).
        kv_offset: absolute position of ``k[0]``, for a caller holding only part of the KV.
        scale: multiplies ``q . k`` before the softmax; None means ``1 / sqrt(head_dim)``.

    Returns:
        ``(out, lse)``, newly allocated and owned by the caller, of the inputs' kind and device:
        ``out`` in q's dtype, ``lse`` float32 (float64 for float64 inputs), natural log.
        Accumulation is float32 (float64 for float64). A (token, head) row with no visible key
        (empty range, or all masked) has ``lse = -inf`` and ``out = 0``: it merges as the
        identity. The inputs are never written; non-contiguous inputs are copied first. On CUDA
        the kernel is enqueued on the current stream of the inputs' device and the call returns
        without synchronizing. No autograd: tensors are detached.

    Raises:
        ValueError: shapes not as above, a bad token range, KV-head index out of range or
            repeated, bad q_positions, inputs on different devices.
        TypeError: unsupported or mismatched dtypes, or a mix of numpy arrays and tensors.
        RuntimeError: CUDA tensors when this build has no CUDA kernels, or no usable device.
    """
    tokens, q_heads, kv_len, kv_heads, head_dim = _check_shapes(q.shape, k.shape, v.shape)
    start, stop = _check_range(token_range, kv_len)
    groups = _check_groups(kv_head_groups, kv_heads)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    kv_offset = operator.index(kv_offset)
    positions = None
    if causal:
        positions = _positions(q_positions, tokens, kv_offset + kv_len)
    call = (start, stop, groups, bool(causal), kv_offset, scale)

    inputs = (q, k, v)
    if all(isinstance(x, np.ndarray) for x in inputs):
        arrays = (np.ascontiguousarray(x) for x in inputs)
        return _C.partial_attention_cpu(*arrays, positions, *call)
    torch = sys.modules.get("torch")
    if torch is None or not all(isinstance(x, torch.Tensor) for x in inputs):
        kinds = ", ".join(type(x).__name__ for x in inputs)
        raise TypeError(f"partial_attention needs three numpy arrays or three tensors, got {kinds}")
    devices = {x.device for x in inputs}
    if len(devices) != 1:
        raise ValueError(f"partial_attention inputs are on different devices: {devices}")
    if len({x.dtype for x in inputs}) != 1:
        raise TypeError(f"q, k and v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    tensors = tuple(x.detach().contiguous() for x in inputs)
    if q.device.type == "cpu":
        return _partial_cpu_tensors(*tensors, positions, call)
    if q.device.type == "cuda":
        return _partial_cuda(*tensors, positions, call)
    raise ValueError(f"partial_attention: unsupported device {q.device}")


def _check_shapes(
    q: Sequence[int], k: Sequence[int], v: Sequence[int]
) -> tuple[int, int, int, int, int]:
    q, k, v = tuple(q), tuple(k), tuple(v)
    if len(q) != 3 or q[2] == 0:
        raise ValueError(f"q must have shape [tokens, q_heads, head_dim], head_dim > 0, got {q}")
    if len(k) != 3:
        raise ValueError(f"k must have shape [kv_len, kv_heads, head_dim], got {k}")
    if v != k:
        raise ValueError(f"v shape {v} != k shape {k}")
    if k[2] != q[2]:
        raise ValueError(f"head_dim of k {k} != head_dim of q {q}")
    if k[1] == 0 or q[1] == 0 or q[1] % k[1] != 0:
        raise ValueError(
            f"q_heads ({q[1]}) must be a positive multiple of kv_heads ({k[1]}) for GQA"
        )
    return q[0], q[1], k[0], k[1], q[2]


def _check_range(token_range: tuple[int, int] | None, kv_len: int) -> tuple[int, int]:
    if token_range is None:
        return 0, kv_len
    try:
        start, stop = (operator.index(x) for x in token_range)
    except (TypeError, ValueError):
        raise ValueError(
            f"token_range must be a pair of ints (start, stop), got {token_range!r}"
        ) from None
    if not 0 <= start <= stop <= kv_len:
        raise ValueError(
            f"token_range {(start, stop)} must satisfy 0 <= start <= stop <= kv_len ({kv_len})"
        )
    return start, stop


def _check_groups(kv_head_groups: Sequence[int] | None, kv_heads: int) -> list[int]:
    """The selected KV heads as a list; [] means all (what the native functions expect)."""
    if kv_head_groups is None:
        return []
    try:
        groups = [operator.index(g) for g in kv_head_groups]
    except TypeError:
        raise ValueError(
            f"kv_head_groups must be KV-head indices, got {kv_head_groups!r}"
        ) from None
    if not groups:
        raise ValueError("kv_head_groups is empty: select at least one KV head, or pass None")
    for g in groups:
        if not 0 <= g < kv_heads:
            raise ValueError(f"kv_head_groups index {g} out of range [0, {kv_heads})")
    if len(set(groups)) != len(groups):
        raise ValueError(f"kv_head_groups has repeated indices: {groups}")
    return groups


def _positions(q_positions: object, tokens: int, seq_end: int) -> np.ndarray:
    if q_positions is None:
        return np.arange(seq_end - tokens, seq_end, dtype=np.int64)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(q_positions, torch.Tensor):
        q_positions = q_positions.detach().cpu().numpy()
    positions = np.asarray(q_positions)
    if positions.shape != (tokens,) or (
        positions.size and not np.issubdtype(positions.dtype, np.integer)
    ):
        raise ValueError(
            f"q_positions must be {tokens} integers (one per token), got dtype "
            f"{positions.dtype} shape {positions.shape}"
        )
    return np.ascontiguousarray(positions, dtype=np.int64)


def _partial_cpu_tensors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: np.ndarray | None,
    call: tuple,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    if q.dtype == torch.bfloat16:
        # numpy has no bfloat16: the kernel reads its bits as uint16 and writes them back.
        bits = (x.view(torch.int16).numpy().view(np.uint16) for x in (q, k, v))
        out, lse = _C.partial_attention_cpu(*bits, positions, *call)
        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16), torch.from_numpy(lse)
    if q.dtype not in (torch.float16, torch.float32, torch.float64):
        raise TypeError(f"partial_attention on CPU tensors: unsupported dtype {q.dtype}")
    out, lse = _C.partial_attention_cpu(q.numpy(), k.numpy(), v.numpy(), positions, *call)
    return torch.from_numpy(out), torch.from_numpy(lse)


def _partial_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: np.ndarray | None,
    call: tuple,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    require_cuda_build("partial_attention")
    code = scalar_type(q.dtype)
    if code is None:
        raise TypeError(f"CUDA partial_attention needs float32, float16 or bfloat16, got {q.dtype}")
    tokens, q_heads, head_dim = q.shape
    kv_len, kv_heads, _ = k.shape
    start, stop, groups, causal, kv_offset, scale = call
    out_heads = (len(groups) if groups else kv_heads) * (q_heads // kv_heads)
    out = torch.empty((tokens, out_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((tokens, out_heads), dtype=torch.float32, device=q.device)
    # Copied on the current stream, which the kernel follows; the caching allocator keeps the
    # buffer from being reused by other streams until that stream is past the kernel.
    pos = torch.from_numpy(positions).to(q.device) if positions is not None else None
    _C.partial_attention_cuda(
        out.data_ptr(),
        lse.data_ptr(),
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        pos.data_ptr() if pos is not None else 0,
        tokens,
        q_heads,
        kv_heads,
        kv_len,
        head_dim,
        start,
        stop,
        groups,
        causal,
        kv_offset,
        scale,
        code,
        *launch_target(q),
    )
    return out, lse
