"""SGLang HiCache L3 backend that keeps KV pages in BanaServe's Global KV Cache Store.

Loaded by SGLang through ``--hicache-storage-backend dynamic`` with the zero-copy v1
interface (``interface_v1: 1``); :func:`hicache_args` builds those flags. Pages move between
SGLang's host KV pool and the store without an intermediate copy: the host pool's page
segments (K and V of every layer, layer-major) are the client's source and destination
buffers, so the bytes on the wire follow :class:`banaserve.kvstore.keys.KvLayout`.

Keys: SGLang chains a SHA-256 over each page's tokens (and every token before it); the store
key namespaces that hash by model, KV layout, tensor-parallel rank and tenant
(:func:`banaserve.kvstore.keys.namespaced_key`). A store that is down or misses a page is a
miss, never an error: SGLang then computes the page itself.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from banaserve.config.store_options import KvStoreOptions
from banaserve.kvstore.keys import KvLayout
from banaserve.router.placement import SGLANG_PREFETCH_THRESHOLD
from banaserve.sglang_ext import request_context
from banaserve.sglang_ext.store_attachment import RankIdentity, StoreAttachment, open_client

logger = logging.getLogger(__name__)

BACKEND_NAME = "banaserve"


def hicache_args(options: KvStoreOptions, urls: Sequence[str]) -> list[str]:
    """SGLang flags that attach an instance to the store at ``urls`` with ``options``.

    The token is not among them (it would show in ``ps``): the backend reads it from
    ``BANASERVE_KV_STORE_TOKEN``, which SGLang's child processes inherit.
    """
    extra = {
        "backend_name": BACKEND_NAME,
        "module_path": __name__,
        "class_name": BanaServeKvStore.__name__,
        "interface_v1": 1,
        **options.to_extra(urls),
    }
    return [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(extra),
        # Layer-major host pages are what the store's layout (and layer-wise gets) expect.
        "--hicache-mem-layout", "layer_first",
        "--hicache-io-backend", "direct",
    ]  # fmt: skip


def _segments(pointers: Sequence[int], sizes: Sequence[int]) -> list[memoryview]:
    """Writable views of raw host-pool memory; valid while SGLang holds those pages for the
    current transfer (the controller does not free them until the call returns)."""
    return [
        memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
        for ptr, size in zip(pointers, sizes, strict=True)
    ]


class BanaServeKvStore(HiCacheStorage):
    """HiCache storage backed by BanaServe's store; called from SGLang's prefetch and backup
    threads at once (the client is thread-safe).

    Owns its store client and, once the host pool is registered, its :class:`StoreAttachment`
    (with coalescing on, claiming per request). The host pool's memory is
    SGLang's: pages are read from and written into it in place, valid for the call. Lookups
    block their (prefetch) thread for up to ``coalesce_wait_s`` on pages another request is
    computing; gets and puts block on the store.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any]) -> None:
        options = KvStoreOptions.from_extra(storage_config.extra_config or {})
        self.config = storage_config
        self.tenant = options.tenant
        # Opened now so that a bad config fails the instance's start; attached to a namespace
        # once the host pool says what its pages look like.
        self._client = open_client(options, "the banaserve HiCache backend")
        self.coalesce_wait_s = options.coalesce_wait_s
        if self.coalesce_wait_s > 0:
            request_context.install()
        self._store: StoreAttachment | None = None
        self.mem_pool_host: Any = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        layout = getattr(mem_pool_host, "layout", None)
        if layout != "layer_first":
            raise ValueError(
                f"the banaserve KV store needs --hicache-mem-layout layer_first, got {layout!r}"
            )
        self.layout = KvLayout(
            num_layers=int(mem_pool_host.layer_num),
            num_kv_heads=int(mem_pool_host.head_num),
            head_dim=int(mem_pool_host.head_dim),
            dtype=str(mem_pool_host.dtype).removeprefix("torch."),
            page_size=int(mem_pool_host.page_size),
        )
        config = self.config
        self._store = StoreAttachment(
            self._client,
            RankIdentity(
                config.model_name,
                (config.tp_rank, config.tp_size),
                (config.pp_rank, config.pp_size),
                self.tenant,
            ),
            self.layout,
            owner=f"{socket.gethostname()}:{os.getpid()}:{config.tp_rank}",
            per_request_owner=True,
            claims=self.coalesce_wait_s > 0,
        )

    @property
    def store(self) -> StoreAttachment:
        if self._store is None:
            raise RuntimeError("the host KV pool was not registered with the store backend")
        return self._store

    def _page_buffers(self, host_indices: Any, pages: int) -> list[list[memoryview]]:
        pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per_page = len(pointers) // pages
        views = _segments(pointers, sizes)
        return [views[i * per_page : (i + 1) * per_page] for i in range(pages)]

    # The zero-copy interface SGLang uses with interface_v1.

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Leading pages in the store. With coalescing on, pages that another request (here
        or on any instance) is computing are waited for, up to ``coalesce_wait_s``, and the
        missing tail is claimed for this request, which will compute and store it. Runs on
        SGLang's prefetch thread, so a wait delays only requests still waiting for their
        prefetch, never the running batch.

        No wait when the hit it could bring is shorter than SGLang's prefetch threshold:
        SGLang would not load it. Chat prompts share a page or two of template and system
        prompt; waiting for them held every opening turn behind the first one's whole prefill
        (benchmark/RESULTS.md, session 30). The threshold is applied per batch of keys SGLang
        asks about: a later batch follows a whole batch of hits, already past it."""
        request_id = request_context.current_request_id()
        store_keys = self.store.keys(keys)
        if self.store.ledger is None or request_id is None:
            return self.store.stored_prefix(store_keys)
        min_wait_keys = -(-SGLANG_PREFETCH_THRESHOLD // self.layout.page_size)
        return self.store.claiming_lookup(
            request_id, store_keys, self.coalesce_wait_s, min_wait_keys
        )

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not keys:
            return []
        return self.store.get(self.store.keys(keys), self._page_buffers(host_indices, len(keys)))

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not keys:
            return []
        return self.store.put(self.store.keys(keys), self._page_buffers(host_indices, len(keys)))

    def exists(self, key: str) -> bool:
        return self._client.exists(self.store.keys([key]))[0]

    # The legacy tensor interface: SGLang does not call it with interface_v1; it is abstract
    # in HiCacheStorage, so it must exist, and it refuses clearly rather than misbehave.

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        raise NotImplementedError("the banaserve KV store backend needs interface_v1")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):  # noqa: ANN201
        raise NotImplementedError("the banaserve KV store backend needs interface_v1")

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:  # fmt: skip
        raise NotImplementedError("the banaserve KV store backend needs interface_v1")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:  # fmt: skip
        raise NotImplementedError("the banaserve KV store backend needs interface_v1")

    def clear(self) -> None:
        logger.info("HiCache clear ignored: the BanaServe store is shared with other instances")

    def close(self) -> None:
        (self._store or self._client).close()  # the attachment owns the client once made
