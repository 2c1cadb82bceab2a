"""Which request a HiCache storage lookup is for.

SGLang's ``HiCacheStorage.batch_exists`` receives page keys but not the request they belong
to, while in-flight coalescing must tell "another request is computing these pages" (wait
for them) from "this request claimed them earlier" (a re-query of the same request must not
wait on itself). SGLang's prefetch thread runs one storage query at a time through
``_storage_hit_query(operation)`` of its cache controller, and the operation carries the
request id: wrapping that method publishes the id in a thread-local for the duration of the
query. Both controllers (``HiCacheController`` and the ``HybridCacheController`` that the
unified radix cache uses) define their own, so both are wrapped.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_local = threading.local()
_installed = False
_install_lock = threading.Lock()


def current_request_id() -> str | None:
    """The request whose storage query runs on this thread, or None outside one."""
    return getattr(_local, "request_id", None)


def install() -> None:
    """Wrap SGLang's storage hit query once per process (idempotent, thread-safe)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )

        for cls in (HiCacheController, HybridCacheController):
            if "_storage_hit_query" in cls.__dict__:
                cls._storage_hit_query = _publishing_request_id(cls.__dict__["_storage_hit_query"])
        _installed = True


def _publishing_request_id(original: Any) -> Any:
    @functools.wraps(original)
    def storage_hit_query(self: Any, operation: Any) -> Any:
        outer = getattr(_local, "request_id", None)  # a subclass may call its parent's
        _local.request_id = getattr(operation, "request_id", None) or outer
        try:
            return original(self, operation)
        finally:
            _local.request_id = outer

    return storage_hit_query
