"""Patch that lets stock SGLang prefill/decode disaggregation (PD) run on the CPU engine.

With it, ``--disaggregation-mode prefill|decode --disaggregation-transfer-backend
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

Checked and left alone (no patch needed): the other ``torch.cuda.Event`` in
``disaggregation/prefill.py`` (early send of a cached prefix) is only reached with the
overlap scheduler, which SGLang turns off on the CPU (``arg_groups/speculative_hook.py``,
``_disable_overlap_schedule_for_cpu``); the PD metadata buffers (``disaggregation/utils.py``)
are CPU tensors already; ``mooncake_tcp`` sets ``MC_FORCE_TCP`` itself
(``arg_groups/pd_disaggregation_hook.py``); the KV pools are plain host memory, which
Mooncake's TCP transport registers as is.
"""

from __future__ import annotations

import types
from collections.abc import Callable


def patch_mooncake_conn(module: types.ModuleType) -> None:
    """Senders hand the scheduler's page indices over synchronously (no pinned copy)."""
    sender = getattr(module, "MooncakeKVSender", None)
    if sender is not None:
        sender.supports_host_tensor_indices = False


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.disaggregation.mooncake.conn": patch_mooncake_conn,
}
