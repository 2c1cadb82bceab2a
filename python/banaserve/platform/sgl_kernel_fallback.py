"""Torch-native stand-ins for the sgl_kernel ops SGLang's CPU engine calls unconditionally.

PyPI's ``sgl_kernel`` loads its CPU ops from the same library as its CUDA ones, which needs
``libcuda.so.1``; on a machine with no NVIDIA driver ``import sgl_kernel`` fails. SGLang's CPU
paths tolerate a missing ``sgl_kernel`` except where they import an op by name; those ops are
provided here, both as module attributes and as ``torch.ops.sgl_kernel.*`` registrations, so
callers of either spelling reach them.
"""

from __future__ import annotations

import ctypes
import logging
import types
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_LIBRARY: Any = None  # the torch.library.Library must outlive this module's callers


def copy_all_layer_kv_cache_cpu(data_ptrs: Any, strides: Any, tgt_loc: Any, src_loc: Any) -> None:
    """Copy rows ``src_loc[j] -> tgt_loc[j]`` inside every KV buffer.

    ``data_ptrs[i]`` is the address of buffer i (one per layer and K/V), ``strides[i]`` its
    row size in bytes. Buffers are owned by SGLang's KV pool and written in place; the
    caller guarantees no concurrent writer. Source rows are read in full before any target
    row is written, so overlapping source and target sets are safe.
    """
    import numpy as np

    tgt = tgt_loc.cpu().numpy().astype(np.int64, copy=False)
    src = src_loc.cpu().numpy().astype(np.int64, copy=False)
    if tgt.size == 0:
        return
    rows = int(max(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buffer = np.ctypeslib.as_array(raw).reshape(rows, stride)
        buffer[tgt] = buffer[src]  # fancy indexing on the right copies first


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    """Write newly allocated KV slots into each request's row of the req-to-token table.

    For request i, ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``
    receives the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc``,
    taken in request order (the CUDA kernel's contract). ``req_to_token`` is owned by SGLang's
    ReqToTokenPool and written in place by the scheduler thread only.
    """
    del pool_len  # the row length; torch indexing knows it
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count]
        taken += count


def _register_torch_ops() -> None:
    global _LIBRARY
    import torch

    if hasattr(torch.ops.sgl_kernel, "copy_all_layer_kv_cache_cpu"):
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        lib.define(f"{name}{schema}")
        lib.impl(name, _OPS[name], "CPU")
    _LIBRARY = lib


#: Imported by name by SGLang's speculative-decoding modules, which every server imports, but
#: called only when speculative decoding is on: that feature stays unavailable without the
#: driver, and says so when used.
_SPECULATIVE_ONLY = (
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)


def _unavailable(name: str) -> Callable[..., None]:
    def op(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available on this machine: sgl_kernel's CPU ops need "
            "the NVIDIA driver library (libcuda.so.1). Speculative decoding is not supported "
            "by BanaServe's CPU platform."
        )

    op.__name__ = name
    return op


_OPS = {
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
}
_SCHEMAS = {
    "copy_all_layer_kv_cache_cpu": "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, "
    "Tensor src_loc) -> ()",
    "assign_req_to_token_pool_cpu": "(Tensor req_pool_indices, Tensor(a!) req_to_token, "
    "Tensor start_offset, Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()",
}


def install(module: types.ModuleType, cause: BaseException) -> None:
    """Complete a half-initialised ``sgl_kernel`` module with the CPU stand-ins."""
    for name, op in _OPS.items():
        setattr(module, name, op)
    for name in _SPECULATIVE_ONLY:
        setattr(module, name, _unavailable(name))
    module.__banaserve_fallback__ = str(cause).strip().splitlines()[0]  # type: ignore[attr-defined]
    _register_torch_ops()
    logger.debug("sgl_kernel unavailable (%s): using BanaServe's CPU stand-ins", cause)
