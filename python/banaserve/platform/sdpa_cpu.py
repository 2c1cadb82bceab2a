"""Zeroed scratch memory in SGLang's torch-native attention backend, the one the CPU uses.

For a request that extends a cached prefix (a radix-cache or KV-store hit),
``TorchNativeAttnBackend._run_sdpa_forward_extend`` runs attention over the whole sequence:
it allocates a query of the full length with ``torch.empty``, fills only the new tokens' rows
and throws the prefix rows' outputs away. Those rows hold whatever the allocator's memory held
before, often denormal floats, and CPU arithmetic on denormals is about 90 times slower
(measured here: 1.4 s instead of 16 ms per layer for 1,060 tokens of SmolLM2-135M, so one
store-loaded request took 16 s on a shared core instead of half a second).

Applied by the import hook right after ``sglang.srt.layers.attention.torch_native_backend``
executes, on the CPU platform only: the module's ``torch.empty`` and ``torch.empty_like``
become ``torch.zeros`` and ``torch.zeros_like``. Attention rows are computed independently
and the shapes do not change, so the rows that are kept are bit for bit what they were;
the other ``empty`` buffers there are outputs that are overwritten in full.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from banaserve.platform.module_view import view_torch_of


def patch_torch_native_backend(module: types.ModuleType) -> None:
    import torch

    view_torch_of(module, empty=torch.zeros, empty_like=torch.zeros_like)


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.layers.attention.torch_native_backend": patch_torch_native_backend,
}
