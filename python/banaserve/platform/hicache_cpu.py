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
  reserve becomes :data:`CPU_HOST_MEMORY_RESERVE_BYTES`. Its ``HostKVCache`` also keeps
  ``pin_memory`` for later allocations: the staging page a storage backend without zero-copy
  reads into (SGLang's ``file`` backend, ``get_dummy_flat_data_page``) asks torch for pinned
  memory, which needs a driver, so every L3 read failed and counted as a miss. On the CPU a
  host pool's ``pin_memory`` is False once it is built.
"""

from __future__ import annotations

import functools
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


def patch_pool_host_base(module: types.ModuleType) -> None:
    """A 1 GiB reserve instead of 10 GiB (read at call time from the module's globals), and
    host pools that pin nothing after their construction."""
    if hasattr(module, "HICACHE_HOST_MEMORY_RESERVE_BYTES"):
        module.HICACHE_HOST_MEMORY_RESERVE_BYTES = CPU_HOST_MEMORY_RESERVE_BYTES
    host_cache = getattr(module, "HostKVCache", None)
    if host_cache is not None and not getattr(host_cache.__init__, "_banaserve_unpinned", False):
        host_cache.__init__ = _unpinned_after(host_cache.__init__)


def _unpinned_after(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # Subclasses allocate after this returns: on the CPU nothing can be pinned.
        self.pin_memory = False

    __init__._banaserve_unpinned = True  # type: ignore[attr-defined]
    return __init__


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.base": patch_pool_host_base,
    "sglang.srt.mem_cache.pool_host.common": patch_pool_host_common,
    "sglang.srt.mem_cache.pool_host.mha": patch_transfer_kv_direct,
    "sglang.srt.mem_cache.memory_pool_host": patch_transfer_kv_direct,
}
