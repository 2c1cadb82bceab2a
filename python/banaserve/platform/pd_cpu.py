"""Patches that let stock SGLang prefill/decode disaggregation (PD) run on the CPU engine.

With them, ``--disaggregation-mode prefill|decode --disaggregation-transfer-backend
mooncake_tcp`` serves on a machine without an NVIDIA driver, with greedy output identical to
one plain instance. Outside this module it takes Debian's ``libibverbs1`` (the Mooncake
transfer engine links it even when it only uses TCP) and the pip package
``mooncake-transfer-engine-non-cuda``; ``sglang-router`` provides the PD router.

Applied by the import hook right after the named SGLang module executes, and only on the
CPU platform:

- ``disaggregation.mooncake.conn``, ``MooncakeKVSender.supports_host_tensor_indices``:
  for a sender with that flag, the prefill scheduler (``disaggregation/prefill.py``,
  ``_send_kv_chunk``) copies the page indices asynchronously into *pinned* host memory
  (``torch.empty(..., pin_memory=True)``, which fails with "Found no NVIDIA driver") and
  orders the copy with a ``torch.cuda.Event``. On the CPU the indices already live in host
  memory: with the flag off the scheduler takes its synchronous path
  (``kv_to_page_indices``), which the Mooncake worker accepts too, and neither pinned memory
  nor the event is touched.
- ``disaggregation.prefill``, ``torch.cuda.Event`` in
  ``SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk``: under the overlap
  scheduler (on by default, on the CPU too) a request whose prefix is in the radix cache
  has that prefix sent early, ordered after the previous forward by a CUDA event recorded on
  the forward stream; on the CPU ``record`` raises "expected stream to be a torch.Stream or
  torch.cuda.Stream object" and kills the prefill scheduler. CPU kernels have finished when
  the forward call returns, so there is nothing to wait for: the module's global ``torch``
  becomes a view of torch whose ``cuda.Event`` does nothing (``record``, ``synchronize``);
  everything else resolves to the real ``torch``. Only that module's name changes.

Checked and left alone: the PD metadata buffers (``disaggregation/utils.py``) are CPU
tensors already; ``mooncake_tcp`` sets ``MC_FORCE_TCP`` itself
(``arg_groups/pd_disaggregation_hook.py``); the KV pools are plain host memory, which
Mooncake's TCP transport registers as is.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from banaserve.platform.module_view import ModuleView, view_torch_of


class _CpuEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is complete when its call returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def record(self, stream: Any = None) -> None:
        del stream

    def wait(self, stream: Any = None) -> None:
        del stream

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def patch_mooncake_conn(module: types.ModuleType) -> None:
    """Senders hand the scheduler's page indices over synchronously (no pinned copy)."""
    sender = getattr(module, "MooncakeKVSender", None)
    if sender is not None:
        sender.supports_host_tensor_indices = False


def patch_prefill(module: types.ModuleType) -> None:
    """Give ``disaggregation/prefill.py`` a ``torch.cuda.Event`` that works on the CPU."""
    import torch

    view_torch_of(module, cuda=ModuleView(torch.cuda, Event=_CpuEvent))


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.disaggregation.mooncake.conn": patch_mooncake_conn,
    "sglang.srt.disaggregation.prefill": patch_prefill,
}
