"""Per-tenant quotas (issue 31, item 6): a tenant that stores more than its share evicts its
own pages only. A real store server in this process, real sockets; before, every keyspace
shared one LRU and the busiest tenant evicted the others' pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from banaserve.kvstore.client import KvStoreClient
from banaserve.kvstore.server import ServerConfig
from banaserve.kvstore.server.tenant_stores import (
    TenantStores,
    build_tenant_stores,
    tenant_folder,
    tenant_quota,
)
from banaserve.kvstore.storage import TieredStore
from banaserve.kvstore.storage.base import PageStore
from support.kvstore_server import TOKEN, InProcessServer, keys_for, pages

MiB = 1 << 20
PAGE = 32 << 10
TENANTS = {"alpha": "alpha-token-0123456789", "beta": "beta-token-0123456789"}


def make(ram: int, folder: Path | None, ssd: int) -> PageStore:
    return TieredStore(ram, ssd_dir=folder, ssd_capacity_bytes=ssd if folder else 0)


def test_quotas_share_the_capacity_or_are_refused() -> None:
    assert tenant_quota(3 * MiB, 2, True, None) == MiB  # equal shares with the shared token
    assert tenant_quota(2 * MiB, 2, False, None) == MiB  # no shared token: the tenants' alone
    assert tenant_quota(3 * MiB, 2, True, MiB // 2) == MiB // 2
    with pytest.raises(ValueError, match="do not fit"):
        tenant_quota(3 * MiB, 2, True, 2 * MiB)
    with pytest.raises(ValueError, match="room for the shared token"):
        tenant_quota(2 * MiB, 2, True, MiB)


def test_a_tenant_over_its_quota_evicts_only_its_own_pages() -> None:
    store = build_tenant_stores(make, 3 * MiB, None, 0, TENANTS, True, None)
    server = InProcessServer(store, ServerConfig(token=TOKEN, tenant_tokens=TENANTS))
    try:
        with (
            KvStoreClient(server.url, token=TENANTS["alpha"]) as alpha,
            KvStoreClient(server.url, token=TENANTS["beta"]) as beta,
            KvStoreClient(server.url, token=TOKEN) as shared,
        ):
            kept = keys_for("beta's", 16)  # 512 KiB, half of beta's quota
            assert beta.put(kept, pages(16, PAGE)) == [True] * 16
            assert shared.put(keys_for("shared", 8), pages(8, PAGE)) == [True] * 8
            flood = keys_for("alpha's", 96)  # 3 MiB: the whole store's capacity
            for start in range(0, 96, 16):
                assert alpha.put(flood[start : start + 16], pages(16, PAGE)) == [True] * 16
            assert beta.exists(kept) == [True] * 16  # every page of beta's is still there
            assert shared.exists(keys_for("shared", 8)) == [True] * 8
            assert alpha.exists(flood[:16]) == [False] * 16  # alpha evicted its own, oldest
            assert all(alpha.exists(flood[-16:]))
            # A tenant's STATS shows its own store (within its quota), nothing of the others'.
            own = alpha.stats()[server.url]
            assert 0 < own["ram_bytes"] <= MiB and own["evicted_ram"] >= 16
            assert beta.stats()[server.url]["evicted_ram"] == 0
            assert shared.stats()[server.url]["ram_pages"] >= 16 + 8 + 16  # the totals
    finally:
        server.close()
        store.close()


def test_each_tenant_has_its_own_ssd_folder(tmp_path: Path) -> None:
    store = build_tenant_stores(make, 3 * MiB, tmp_path, 6 * MiB, TENANTS, True, None)
    try:
        assert isinstance(store, TenantStores)
        for tenant in TENANTS:
            assert store.for_tenant(tenant).put(b"k" * 32, b"v" * PAGE)
        store.flush()
        folders = [tenant_folder(tmp_path, t) for t in TENANTS]
        assert folders[0] != folders[1]
        assert all(any(folder.rglob("*.page")) for folder in folders)
    finally:
        store.close()
