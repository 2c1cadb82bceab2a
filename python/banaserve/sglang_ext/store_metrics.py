"""What an instance's store traffic costs, on SGLang's ``/metrics``.

Two counters, labelled by ``op``:

- ``banaserve:kv_store_seconds_total{op="lookup"|"get"|"put"}``: wall seconds the adapters
  spent in store calls. A lookup includes its wait for pages another request is computing:
  on a decode instance, the handoff's wait for the prefill instance's pages;
- ``banaserve:kv_store_bytes_total{op="get"|"put"}``: page bytes read and written.

With ``--enable-metrics`` SGLang runs its schedulers with ``PROMETHEUS_MULTIPROC_DIR`` set, so
what a scheduler process (where the adapters run) counts appears on the HTTP server's
``/metrics``; without it the counters live in the process's default registry only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SECONDS = "banaserve:kv_store_seconds"
BYTES = "banaserve:kv_store_bytes"
OPS = ("lookup", "get", "put")


class StoreMetrics:
    """The process's two store counters. Thread-safe (Prometheus counters are); one per
    process, from :func:`store_metrics`, since a registry takes each name once."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        self._seconds = Counter(SECONDS, "Seconds spent in KV store calls", ["op"])
        self._bytes = Counter(BYTES, "KV page bytes read from / written to the store", ["op"])

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        """Count the seconds of the ``with`` body as ``op``'s, whether it raises or not."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds.labels(op=op).inc(time.perf_counter() - start)

    def moved(self, op: str, nbytes: int) -> None:
        if nbytes > 0:
            self._bytes.labels(op=op).inc(nbytes)

    def value(self, counter: str, op: str) -> float:
        """The counter's value in this process (for tests)."""
        family: Any = self._seconds if counter == SECONDS else self._bytes
        return float(family.labels(op=op)._value.get())


_metrics: StoreMetrics | None = None
_lock = threading.Lock()


def store_metrics() -> StoreMetrics:
    """This process's :class:`StoreMetrics`, created on first use."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = StoreMetrics()
        return _metrics
