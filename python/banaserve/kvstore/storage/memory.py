"""The RAM tier: an LRU of pages bounded by the sum of their byte lengths."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from ..keys import KEY_BYTES
from .base import PageStore, StoreStats

logger = logging.getLogger(__name__)

EvictCallback = Callable[[bytes, bytes], None]


def check_key(key: bytes) -> None:
    """Raise ValueError unless ``key`` is a 32-byte ``bytes`` (a programming error, not a miss)."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"page keys are {KEY_BYTES} raw bytes, got {key!r:.80}")


class MemoryStore(PageStore):
    """Pages in host RAM, least recently used evicted first.

    Capacity counts value bytes only (keys and dict overhead are not charged). The store keeps
    a reference to each ``bytes`` value it is given and hands that same object out on ``get``;
    since ``bytes`` is immutable, callers may keep it after eviction.

    Locking: one lock guards the dict and counters; no I/O happens under it. ``on_evict`` runs
    in the thread whose ``put`` caused the eviction, *after* the lock is released and after the
    new page is visible, once per evicted page in eviction order. An exception from it is
    logged and swallowed so that one failing callback cannot hide the other evictions.
    """

    def __init__(self, capacity_bytes: int, on_evict: EvictCallback | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._pages: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._puts = 0
        self._evicted = 0

    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` (most recently used), evicting LRU pages to make room; False and no
        change if ``value`` is larger than the whole capacity. Never blocks on I/O."""
        return self._insert(key, value, replace=True)

    def put_if_absent(self, key: bytes, value: bytes) -> bool:
        """Like ``put`` but leaves an existing page alone (returns True then).

        Used to promote a page read from a slower tier: a concurrent ``put`` of a newer value
        must win over the promotion of an older copy."""
        return self._insert(key, value, replace=False)

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            value = self._pages.get(key)
            if value is None:
                self._misses += 1
                return None
            self._pages.move_to_end(key)
            self._hits += 1
            return value

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pages

    def clear(self) -> int:
        return len(self.drop_all())

    def drop_all(self) -> list[bytes]:
        """Drop every page (``on_evict`` is not called: nothing is evicted); their keys."""
        with self._lock:
            keys = list(self._pages)
            self._pages.clear()
            self._bytes = 0
        return keys

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                ram_pages=len(self._pages),
                ram_bytes=self._bytes,
                hits=self._hits,
                misses=self._misses,
                puts=self._puts,
                evicted_ram=self._evicted,
            )

    def _insert(self, key: bytes, value: bytes, *, replace: bool) -> bool:
        check_key(key)
        # bytes(b) is b itself for bytes; anything mutable is copied so we own what we keep.
        value = bytes(value)
        size = len(value)
        if size > self.capacity_bytes:
            return False
        victims: list[tuple[bytes, bytes]] = []
        with self._lock:
            old = self._pages.get(key)
            if old is not None:
                if not replace:
                    return True
                self._bytes -= len(old)
                del self._pages[key]
            self._pages[key] = value
            self._bytes += size
            self._puts += 1
            while self._bytes > self.capacity_bytes:
                # The new page is last and fits alone, so the loop stops before reaching it.
                victim_key, victim = self._pages.popitem(last=False)
                self._bytes -= len(victim)
                self._evicted += 1
                victims.append((victim_key, victim))
        if self._on_evict is not None:
            for victim_key, victim in victims:
                try:
                    self._on_evict(victim_key, victim)
                except Exception:
                    logger.exception("on_evict callback failed for page %s", victim_key.hex())
        return True
