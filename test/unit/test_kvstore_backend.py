"""The HiCache backend over a real store server (in process, real sockets): a page one
instance's host pool stores is a hit, byte for byte, in another instance's host pool of the
same model, and invisible to another tenant; the bytes moved are counted for ``/metrics``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
import pytest

from banaserve.config.store_options import KvStoreOptions
from banaserve.sglang_ext.store_metrics import BYTES, SECONDS, store_metrics
from support.kvstore_claims import in_process_server
from support.kvstore_server import TOKEN, InProcessServer

if TYPE_CHECKING:
    from banaserve.sglang_ext.kvstore_backend import BanaServeKvStore

#: a fresh in-process store server for each test
server = pytest.fixture(in_process_server)

LAYERS, HEADS, DIM, PAGE = 2, 1, 4, 4


class HostPool:
    """What the backend reads of SGLang's host KV pool: its shape and its pages' segments
    (K and V of every layer, layer-major), here numpy rows."""

    layout = "layer_first"
    layer_num, head_num, head_dim, page_size, dtype = LAYERS, HEADS, DIM, PAGE, "torch.float32"

    def __init__(self, pages: int) -> None:
        self.segments = np.zeros((pages, 2 * LAYERS, PAGE * HEADS * DIM), dtype=np.float32)

    def get_page_buffer_meta(self, host_indices: list[int]) -> tuple[list[int], list[int]]:
        pages = [i // PAGE for i in host_indices[::PAGE]]
        rows = [self.segments[p, s] for p in pages for s in range(2 * LAYERS)]
        return [r.ctypes.data for r in rows], [r.nbytes for r in rows]


def backend(url: str, tenant: str = "") -> BanaServeKvStore:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from banaserve.sglang_ext.kvstore_backend import BanaServeKvStore, hicache_args

    argv = hicache_args(KvStoreOptions([url], tenant=tenant, coalesce_wait_s=0.0), [url])
    extra = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
    config = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, False, "tiny",
                                  extra_config={**extra, "token": TOKEN})  # fmt: skip
    return BanaServeKvStore(config, {})


def slots(*pages: int) -> list[int]:
    return [p * PAGE + t for p in pages for t in range(PAGE)]


def test_a_page_stored_by_one_instance_is_a_hit_on_another(server: InProcessServer) -> None:
    a, b, other = backend(server.url), backend(server.url), backend(server.url, tenant="t")
    pools = [HostPool(4), HostPool(4), HostPool(4)]
    try:
        with pytest.raises(RuntimeError, match="not registered"):
            a.exists("h0")
        for store, pool in zip((a, b, other), pools, strict=True):
            store.register_mem_pool_host(pool)
        pools[0].segments[1:3] = np.random.default_rng(0).random((2, 2 * LAYERS, 16))
        metrics = store_metrics()
        before = {op: metrics.value(BYTES, op) for op in ("get", "put")}
        lookup_s = metrics.value(SECONDS, "lookup")
        assert a.batch_set_v1(["h0", "h1"], slots(1, 2)) == [True, True]
        assert b.batch_exists(["h0", "h1", "h2"]) == 2
        assert b.batch_get_v1(["h0", "h1", "h2"], slots(3, 0, 2)) == [True, True, False]
        page_bytes = pools[0].segments[0].nbytes
        for op in ("get", "put"):  # the two pages found and stored; not the missing third
            assert metrics.value(BYTES, op) - before[op] == 2 * page_bytes
        assert metrics.value(SECONDS, "lookup") > lookup_s
        assert np.array_equal(pools[1].segments[3], pools[0].segments[1])
        assert np.array_equal(pools[1].segments[0], pools[0].segments[2])
        assert other.batch_exists(["h0", "h1"]) == 0  # another tenant's namespace
    finally:
        for store in (a, b, other):
            store.close()
