"""Exact merge of two partial attention results (numpy arrays or torch tensors).

torch is not imported with this module: a tensor can only arrive if the caller imported torch, so
the dispatcher finds it in `sys.modules`, and the tensor paths import it only after that.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from banaserve import _C
from banaserve.attention._cuda import launch_target, require_cuda_build, scalar_type

if TYPE_CHECKING:
    import torch

    Array = TypeVar("Array", np.ndarray, torch.Tensor)
else:
    Array = TypeVar("Array")

__all__ = ["merge_attn_states", "merge_many"]


def merge_attn_states(
    out_a: Array, lse_a: Array, out_b: Array, lse_b: Array
) -> tuple[Array, Array]:
    """Merge the attention outputs of two disjoint key ranges A and B into that of A ∪ B.

    Per (token, head) row, with lse the natural-log log-sum-exp of the attention scores::

        lse = log(exp(lse_a) + exp(lse_b))
        out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

    computed stably (max-subtracted) with float32 accumulation (float64 for float64 inputs).
    The result equals attention over A ∪ B up to rounding.

    Args:
        out_a, out_b: ``[tokens, heads, head_dim]``, same dtype. numpy: float16, float32 or
            float64. torch CPU: those or bfloat16. torch CUDA: float32, float16 or bfloat16.
        lse_a, lse_b: ``[tokens, heads]``, same dtype: float32, or float64 on the CPU.
            ``-inf`` marks a row whose range is empty: that side's ``out`` is then not read,
            so it may hold anything (NaN included). If both sides are empty the row's result
            is ``out = 0``, ``lse = -inf``.

    Returns:
        ``(out, lse)``: newly allocated, owned by the caller, of the input dtypes and of the
        same kind (numpy arrays, or tensors on the inputs' device). The inputs are never
        written; non-contiguous inputs are copied first. On CUDA the merge is enqueued on the
        current stream of the inputs' device and the call returns without synchronizing.
        No autograd: tensors are detached.

    Raises:
        ValueError: shapes that do not match the layout above, or inputs on different devices.
        TypeError: an unsupported or mismatched dtype, or a mix of numpy arrays and tensors.
        RuntimeError: CUDA tensors when this build has no CUDA kernels, or no usable device.
    """
    _check_shapes(out_a.shape, lse_a.shape, out_b.shape, lse_b.shape)
    inputs = (out_a, lse_a, out_b, lse_b)
    if all(isinstance(x, np.ndarray) for x in inputs):
        return _C.merge_attn_states_cpu(*(np.ascontiguousarray(x) for x in inputs))
    torch = sys.modules.get("torch")
    if torch is None or not all(isinstance(x, torch.Tensor) for x in inputs):
        kinds = ", ".join(type(x).__name__ for x in inputs)
        raise TypeError(f"merge_attn_states needs four numpy arrays or four tensors, got {kinds}")
    devices = {x.device for x in inputs}
    if len(devices) != 1:
        raise ValueError(f"merge_attn_states inputs are on different devices: {devices}")
    tensors = tuple(x.detach().contiguous() for x in inputs)
    if out_a.device.type == "cuda":
        return _merge_cuda(*tensors)
    if out_a.device.type == "cpu":
        return _merge_cpu_tensors(*tensors)
    raise ValueError(f"merge_attn_states: unsupported device {out_a.device}")


def merge_many(partials: Iterable[tuple[Array, Array]]) -> tuple[Array, Array]:
    """Merge the ``(out, lse)`` partials of any number of disjoint key ranges into one.

    Folds `merge_attn_states` left to right. The merge is commutative and associative up to
    rounding, so the partials may come in any order (e.g. as the sides of a split finish);
    a partial with ``lse = -inf`` rows (an empty range) is the identity for those rows.

    Args:
        partials: at least one ``(out, lse)`` pair, all with the shapes, dtypes, kind and
            device that `merge_attn_states` accepts together.

    Returns:
        ``(out, lse)`` for the union of the ranges. With a single partial, that pair itself
        (not a copy); otherwise newly allocated arrays/tensors owned by the caller.

    Raises:
        ValueError: no partials, or an item that is not an ``(out, lse)`` pair; and whatever
            `merge_attn_states` raises for mismatched shapes, dtypes or devices.
    """
    merged: tuple[Array, Array] | None = None
    for i, pair in enumerate(partials):
        try:
            out, lse = pair
        except (TypeError, ValueError):
            raise ValueError(f"partials[{i}] must be an (out, lse) pair") from None
        merged = (out, lse) if merged is None else merge_attn_states(*merged, out, lse)
    if merged is None:
        raise ValueError("merge_many needs at least one (out, lse) partial")
    return merged


def _check_shapes(
    out_a: Sequence[int], lse_a: Sequence[int], out_b: Sequence[int], lse_b: Sequence[int]
) -> None:
    out_a, lse_a, out_b, lse_b = (tuple(s) for s in (out_a, lse_a, out_b, lse_b))
    if len(out_a) != 3 or out_a[2] == 0:
        raise ValueError(
            f"out_a must have shape [tokens, heads, head_dim] with head_dim > 0, got {out_a}"
        )
    if out_b != out_a:
        raise ValueError(f"out_b shape {out_b} != out_a shape {out_a}")
    for name, shape in (("lse_a", lse_a), ("lse_b", lse_b)):
        if shape != out_a[:2]:
            raise ValueError(f"{name} must have shape [tokens, heads] = {out_a[:2]}, got {shape}")


def _merge_cpu_tensors(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    # numpy has no bfloat16: merge a float32 copy and round the result back.
    if out_a.dtype == torch.bfloat16 and out_b.dtype == torch.bfloat16:
        out, lse = _merge_cpu_tensors(out_a.float(), lse_a, out_b.float(), lse_b)
        return out.to(torch.bfloat16), lse
    out, lse = _C.merge_attn_states_cpu(out_a.numpy(), lse_a.numpy(), out_b.numpy(), lse_b.numpy())
    return torch.from_numpy(out), torch.from_numpy(lse)


def _merge_cuda(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    require_cuda_build("merge_attn_states")
    code = scalar_type(out_a.dtype)
    if code is None or out_b.dtype != out_a.dtype:
        raise TypeError(
            f"CUDA merge needs out_a/out_b of one dtype among float32, float16, bfloat16; "
            f"got {out_a.dtype}, {out_b.dtype}"
        )
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise TypeError(f"CUDA merge needs float32 lse, got {lse_a.dtype}, {lse_b.dtype}")
    out = torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    tokens, heads, head_dim = out_a.shape
    _C.merge_attn_states_cuda(
        out.data_ptr(),
        lse.data_ptr(),
        out_a.data_ptr(),
        lse_a.data_ptr(),
        out_b.data_ptr(),
        lse_b.data_ptr(),
        tokens,
        heads,
        head_dim,
        code,
        *launch_target(out_a),
    )
    return out, lse
