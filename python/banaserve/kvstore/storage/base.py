"""The interface of a page store tier (RAM, SSD, or both)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class StoreStats:
    """Counters since start; ``pages``/``bytes`` are current totals per tier."""

    ram_pages: int = 0
    ram_bytes: int = 0
    ssd_pages: int = 0
    ssd_bytes: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evicted_ram: int = 0
    evicted_ssd: int = 0
    corrupt_dropped: int = 0
    #: Gets served by the SSD tier (a RAM miss that was promoted); included in ``hits``.
    ssd_hits: int = 0
    #: Pages accepted but not yet on SSD (the write-through queue); a current total.
    ssd_pending_pages: int = 0
    #: Background SSD writes that failed (disk full, permissions); those pages live in RAM only.
    ssd_write_errors: int = 0


class PageStore(ABC):
    """Pages by 32-byte key. Values are immutable ``bytes``.

    Thread-safety: every method may be called from several threads at once; implementations
    lock internally and never hold a lock while doing disk I/O that others wait on longer
    than one page. A returned ``bytes`` object is the caller's: eviction never invalidates it.
    """

    @abstractmethod
    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` under ``key`` (replacing an existing page). False if it cannot fit
        even in an empty store; nothing changes then."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The page, or None (a miss). Counts a hit or a miss; refreshes LRU order."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored in any tier; does not count a hit or change LRU order."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""

    @abstractmethod
    def clear(self) -> int:
        """Drop every page of every tier; returns how many distinct pages were dropped. Not
        counted as evictions; the other counters run on. A ``put`` that returned before the
        call is dropped, one that starts after it returned is kept; a concurrent one either."""

    def for_tenant(self, tenant: str | None) -> PageStore:
        """The store of ``tenant``'s keyspace (None: the shared one): this store, unless
        tenants have quotas (:class:`~banaserve.kvstore.server.tenant_stores.TenantStores`)."""
        return self

    def flush(self) -> None:  # noqa: B027 - optional for tiers with no background writes
        """Block until every accepted page is durable in the last tier (no-op without SSD)."""

    def close(self) -> None:  # noqa: B027
        """Flush and release resources; the store is unusable afterwards."""
