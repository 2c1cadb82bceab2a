"""Per-tenant quotas: each tenant's keyspace in a page store of its own, so that one tenant's
pages never evict another's (issue 31, item 6).

A stored page does not record its keyspace (its key is a hash, see
:mod:`banaserve.kvstore.auth`), so one LRU over every tenant would let the busiest evict the
others. :class:`TenantStores` gives each tenant a RAM (and SSD) share of its own, its quota,
and the shared token's keyspace the rest; the server picks a connection's store by what its
token grants (:meth:`PageStore.for_tenant`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from banaserve.kvstore.storage.base import PageStore, StoreStats

#: Makes one store: (RAM bytes, SSD folder or None, SSD bytes).
MakeStore = Callable[[int, Path | None, int], PageStore]


def tenant_quota(capacity: int, tenants: int, shared: bool, quota: int | None) -> int:
    """The bytes of RAM each of ``tenants`` gets: ``quota`` when given, else an equal share
    with the shared keyspace (when ``shared``: a shared token is configured). ValueError when
    the quotas do not fit ``capacity`` (with room left for the shared keyspace)."""
    if tenants < 1:
        raise ValueError("tenant quotas need tenants")
    keyspaces = tenants + shared
    if quota is None:
        return capacity // keyspaces
    left = capacity - quota * tenants
    if quota <= 0 or left < 0 or (shared and left <= 0):
        raise ValueError(
            f"{tenants} tenant quotas of {quota} bytes do not fit a capacity of {capacity} "
            f"bytes{' with room for the shared token' if shared else ''}"
        )
    return quota


class TenantStores(PageStore):
    """The shared keyspace's store (the :class:`PageStore` methods) and each tenant's
    (:meth:`for_tenant`). Owns every store it holds: :meth:`close` closes them all. The
    mapping never changes; each store is thread-safe, so this is too."""

    def __init__(self, shared: PageStore, tenants: dict[str, PageStore]) -> None:
        self.shared = shared
        self.tenants = dict(tenants)

    def for_tenant(self, tenant: str | None) -> PageStore:
        if tenant is None:
            return self.shared
        return self.tenants[tenant]  # only a configured tenant's token grants a tenant

    def _all(self) -> list[PageStore]:
        return [self.shared, *self.tenants.values()]

    def put(self, key: bytes, value: bytes) -> bool:
        return self.shared.put(key, value)

    def get(self, key: bytes) -> bytes | None:
        return self.shared.get(key)

    def contains(self, key: bytes) -> bool:
        return self.shared.contains(key)

    def stats(self) -> StoreStats:
        """The totals over every keyspace (what the shared token's STATS reports)."""
        return sum_stats(store.stats() for store in self._all())

    def clear(self) -> int:
        return sum(store.clear() for store in self._all())

    def flush(self) -> None:
        for store in self._all():
            store.flush()

    def close(self) -> None:
        for store in self._all():
            store.close()


def sum_stats(all_stats: Iterable[StoreStats]) -> StoreStats:
    total = StoreStats()
    for stats in all_stats:
        for name, value in asdict(stats).items():
            setattr(total, name, getattr(total, name) + value)
    return total


def tenant_folder(ssd_dir: Path, tenant: str) -> Path:
    """A tenant's SSD folder: named by a digest (a tenant name is any text), stable across
    restarts so that its pages are found again."""
    return ssd_dir / "tenants" / hashlib.sha256(tenant.encode()).hexdigest()[:32]


def build_tenant_stores(
    make: MakeStore, capacity: int, ssd_dir: Path | None, ssd_capacity: int,
    tenants: Iterable[str], shared: bool, quota: int | None,
) -> TenantStores:  # fmt: skip
    """Each tenant's store with its quota of RAM (and the same fraction of the SSD tier, in
    :func:`tenant_folder`), the shared keyspace's with the rest."""
    names = sorted(tenants)
    each = tenant_quota(capacity, len(names), shared, quota)
    ssd_each = ssd_capacity * each // capacity
    made: dict[str, PageStore] = {}
    try:
        for name in names:
            folder = tenant_folder(ssd_dir, name) if ssd_dir is not None else None
            made[name] = make(each, folder, ssd_each)
        rest = capacity - each * len(names)
        ssd_rest = ssd_capacity - ssd_each * len(names)
        # No shared token: the shared keyspace is never reached; a token-less store is a page.
        shared_store = make(max(rest, 1), ssd_dir if shared else None, ssd_rest if shared else 0)
    except BaseException:
        for store in made.values():
            store.close()
        raise
    return TenantStores(shared_store, made)
