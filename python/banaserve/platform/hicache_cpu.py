"""Patches that let SGLang's HiCache (host KV pool + L3 storage) run on the CPU engine.

Applied by the import hook right after the named SGLang module executes, and only on the
CPU platform:

- ``mem_cache.pool_host.common``: host pools ask CUDA to pin (``cudaHostRegister``) their
  memory, which needs a driver. Pinning only speeds up device copies, and on the CPU the
  "device" is host memory, so registration becomes a no-op.
- ``mem_cache.pool_host.mha`` / ``mem_cache.memory_pool_host``: with
  ``--hicache-io-backend direct --hicache-mem-layout layer_first`` they call
  ``transfer_kv_direct``, imported only on CUDA/ROCm/XPU; a torch-native copy stands in.
- ``mem_cache.pool_host.base``: host pools may only take RAM beyond a reserve of 10 GiB
  (``HICACHE_HOST_MEMORY_RESERVE_BYTES``), sized for GPU servers whose host RAM serves
  nothing else; on the CPU the device pool itself is host RAM, sized by BanaServe from what
  is free, so an instance would refuse to start on a machine with less than 10 GiB free. The
  reserve becomes :data:`CPU_HOST_MEMORY_RESERVE_BYTES`.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

_REGISTERED_RANGES_ATTR = "_sglang_cuda_host_registered_ranges"
#: RAM HiCache host pools leave free on the CPU platform.
CPU_HOST_MEMORY_RESERVE_BYTES = 1 << 30


def _no_host_register(buffer: Any, registration_granularity_bytes: int | None = None) -> None:
    del registration_granularity_bytes
    setattr(buffer, _REGISTERED_RANGES_ATTR, [])  # nothing for destroy() to unregister


def _no_host_unregister(buffer: Any) -> None:
    del buffer


def transfer_kv_direct(
    src_layers: list[Any],
    dst_layers: list[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """Copy token rows ``src_indices -> dst_indices`` from each source layer buffer to the
    matching destination buffer (K and V of one or all layers). Buffers are owned by SGLang's
    device and host pools; the caller (the HiCache controller thread) orders the copy."""
    del page_size  # only a batching hint for the CUDA kernel
    src = src_indices.to(device="cpu", dtype=_long())
    dst = dst_indices.to(device="cpu", dtype=_long())
    for source, target in zip(src_layers, dst_layers, strict=True):
        target[dst] = source[src]


def _long() -> Any:
    import torch

    return torch.long


def patch_pool_host_common(module: types.ModuleType) -> None:
    module._cuda_host_register = _no_host_register  # type: ignore[attr-defined]
    module._cuda_host_unregister = _no_host_unregister  # type: ignore[attr-defined]


def patch_transfer_kv_direct(module: types.ModuleType) -> None:
    if not hasattr(module, "transfer_kv_direct"):
        module.transfer_kv_direct = transfer_kv_direct  # type: ignore[attr-defined]


def patch_host_memory_reserve(module: types.ModuleType) -> None:
    """A 1 GiB reserve instead of 10 GiB: read at call time from the module's globals."""
    if hasattr(module, "HICACHE_HOST_MEMORY_RESERVE_BYTES"):
        module.HICACHE_HOST_MEMORY_RESERVE_BYTES = CPU_HOST_MEMORY_RESERVE_BYTES


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.base": patch_host_memory_reserve,
    "sglang.srt.mem_cache.pool_host.common": patch_pool_host_common,
    "sglang.srt.mem_cache.pool_host.mha": patch_transfer_kv_direct,
    "sglang.srt.mem_cache.memory_pool_host": patch_transfer_kv_direct,
}
