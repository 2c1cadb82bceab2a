"""RAM in front of an optional SSD tier, with one background write-through thread."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path

from .base import PageStore, StoreStats
from .memory import MemoryStore, check_key
from .ssd import SsdStore

logger = logging.getLogger(__name__)


class TieredStore(PageStore):
    """The store a KV store server owns: a RAM LRU, and with ``ssd_dir`` an SSD tier behind it.

    Without ``ssd_dir`` this is a ``MemoryStore``: pages evicted from RAM are gone.

    With ``ssd_dir`` every accepted page is written through to SSD by one background thread,
    so the SSD holds everything (up to its own capacity) and RAM holds the hot subset. Until
    its write completes a page sits in a pending queue, which ``get`` also serves from, so a
    page evicted from RAM before reaching disk is not lost. A RAM miss that hits SSD (or the
    queue) promotes the page back into RAM.

    Blocking: ``put`` never does disk I/O itself, but when ``max_pending_pages`` pages are
    waiting it blocks until the writer finishes one (about one page write) rather than drop
    pages; a re-put of a key already pending replaces its value and never blocks. ``get`` on
    a RAM miss reads one SSD file in the caller's thread. ``flush`` blocks until the queue is
    empty; ``close`` flushes, stops the writer and releases the directory, after which ``put``
    raises RuntimeError. Call ``close`` before exit: the writer is a daemon thread, so pages
    still queued when the interpreter exits without ``close`` are not written.

    Writer errors (disk full, permissions, I/O errors) are logged and counted in
    ``ssd_write_errors``; the page is then in RAM only and lost once RAM evicts it.

    A page must fit in RAM and (with SSD) in the SSD capacity, else ``put`` returns False.
    Concurrent puts of one key with *different* values may leave the tiers disagreeing; keys
    are content hashes, so equal keys carry equal bytes and this does not arise in use.

    Thread-safety: all methods may be called from any thread. ``stats`` merges per-tier
    snapshots taken one after the other, so totals across tiers may be off by in-flight ops.
    """

    def __init__(
        self,
        ram_capacity_bytes: int,
        ssd_dir: Path | None = None,
        ssd_capacity_bytes: int = 0,
        *,
        max_pending_pages: int = 64,
        fsync: bool = False,
    ) -> None:
        if max_pending_pages < 1:
            raise ValueError(f"max_pending_pages must be >= 1, got {max_pending_pages}")
        self._ram = MemoryStore(ram_capacity_bytes)
        self._ssd: SsdStore | None = None
        if ssd_dir is not None:
            self._ssd = SsdStore(Path(ssd_dir), ssd_capacity_bytes, fsync=fsync)
        self._max_pending = max_pending_pages
        # Guards the counters, the pending queue and _closed; no I/O is done under it.
        self._cond = threading.Condition()
        # Pages accepted but not yet on SSD, oldest first. An entry leaves only after its
        # write finished, so get() finds a page either here or on SSD at every moment.
        self._pending: OrderedDict[bytes, bytes] = OrderedDict()
        self._writing = False  # the writer holds a page it took from _pending (not yet on SSD)
        self._closed = False
        self._hits = 0
        self._ssd_hits = 0
        self._misses = 0
        self._puts = 0
        self._write_errors = 0
        self._writer: threading.Thread | None = None
        if self._ssd is not None:
            self._writer = threading.Thread(
                target=self._write_loop, name="kvstore-ssd-writer", daemon=True
            )
            self._writer.start()

    @property
    def ram(self) -> MemoryStore:
        """The RAM tier (for inspection; writing to it directly bypasses the SSD)."""
        return self._ram

    @property
    def ssd(self) -> SsdStore | None:
        """The SSD tier, if any (for inspection)."""
        return self._ssd

    @property
    def capacity_bytes(self) -> int:
        """The largest page ``put`` accepts."""
        if self._ssd is None:
            return self._ram.capacity_bytes
        return min(self._ram.capacity_bytes, self._ssd.capacity_bytes)

    def put(self, key: bytes, value: bytes) -> bool:
        """Store the page in RAM and queue it for SSD; may block while the queue is full
        (see class doc). False, with nothing changed, if the page exceeds ``capacity_bytes``."""
        check_key(key)
        value = bytes(value)  # no copy for bytes; we keep a reference, so own it
        if len(value) > self.capacity_bytes:
            return False
        with self._cond:
            if self._ssd is not None:
                while key not in self._pending and len(self._pending) >= self._max_pending:
                    if self._closed:
                        break
                    self._cond.wait()
                if self._closed:
                    raise RuntimeError("TieredStore is closed")
                self._pending[key] = value
                self._cond.notify_all()
            elif self._closed:
                raise RuntimeError("TieredStore is closed")
            self._puts += 1
        self._ram.put(key, value)
        return True

    def get(self, key: bytes) -> bytes | None:
        value = self._ram.get(key)
        if value is not None:
            if self._ssd is not None:
                # Keep the SSD's LRU in step with use, or pages hot in RAM would age out of SSD.
                self._ssd.touch(key)
            with self._cond:
                self._hits += 1
            return value
        from_ssd = False
        if self._ssd is not None:
            with self._cond:
                value = self._pending.get(key)
            if value is None:
                value = self._ssd.get(key)
                from_ssd = value is not None
            if value is not None:
                # put_if_absent: a put racing with this read must not be undone by an older copy.
                self._ram.put_if_absent(key, value)
        with self._cond:
            if value is None:
                self._misses += 1
            else:
                self._hits += 1
                self._ssd_hits += from_ssd
        return value

    def contains(self, key: bytes) -> bool:
        if self._ram.contains(key):
            return True
        if self._ssd is None:
            return False
        with self._cond:
            if key in self._pending:
                return True
        return self._ssd.contains(key)

    def stats(self) -> StoreStats:
        ram = self._ram.stats()
        ssd = self._ssd.stats() if self._ssd is not None else StoreStats()
        with self._cond:
            return StoreStats(
                ram_pages=ram.ram_pages,
                ram_bytes=ram.ram_bytes,
                ssd_pages=ssd.ssd_pages,
                ssd_bytes=ssd.ssd_bytes,
                hits=self._hits,
                misses=self._misses,
                puts=self._puts,
                evicted_ram=ram.evicted_ram,
                evicted_ssd=ssd.evicted_ssd,
                corrupt_dropped=ssd.corrupt_dropped,
                ssd_hits=self._ssd_hits,
                ssd_pending_pages=len(self._pending),
                ssd_write_errors=self._write_errors,
            )

    def clear(self) -> int:
        """Drop every page: RAM, the pending queue and SSD (see ``PageStore.clear``). Waits for
        the page being written, if any, so that it cannot land on SSD after the clear (a get
        racing with the clear may still bring back into RAM the page it read)."""
        with self._cond:
            dropped = set(self._pending)
            self._pending.clear()
            self._cond.notify_all()  # puts waiting for queue space go on
            while self._writing:
                self._cond.wait()
        dropped.update(self._ram.drop_all())
        if self._ssd is not None:
            dropped.update(self._ssd.drop_all())
        return len(dropped)

    def flush(self) -> None:
        """Block until every page accepted so far has been written to SSD (or failed)."""
        with self._cond:
            while self._pending:
                self._cond.wait()

    def close(self) -> None:
        """Flush, stop the writer, release the SSD directory. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True  # puts waiting for queue space now raise instead
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join()  # the writer drains the queue before it exits
        if self._ssd is not None:
            self._ssd.close()

    def _write_loop(self) -> None:
        assert self._ssd is not None
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return  # closed and drained
                key, value = next(iter(self._pending.items()))
                self._writing = True
            try:
                self._ssd.put(key, value)
            except Exception as exc:
                self._record_write_error(key, exc)
            with self._cond:
                self._writing = False
                # A re-put during the write replaced the value: keep it queued for another write.
                if self._pending.get(key) is value:
                    del self._pending[key]
                self._cond.notify_all()

    def _record_write_error(self, key: bytes, exc: Exception) -> None:
        with self._cond:
            self._write_errors += 1
            n = self._write_errors
        # A full disk fails every write: log at powers of two so the log stays readable.
        if n & (n - 1) == 0:
            logger.warning(
                "SSD write of page %s failed (%d failures so far); page stays in RAM only: %r",
                key.hex(),
                n,
                exc,
            )
