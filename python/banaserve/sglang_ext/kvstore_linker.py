"""SGLang unified-cache external linker that loads prefix KV from BanaServe's Global KV Cache
Store layer by layer (step 2 of docs/layerwise_loading.md).

Loaded by SGLang with::

    --enable-unified-cache-external-linker
    --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "BanaServeLinker",
        "linker_module_path": "banaserve.sglang_ext.kvstore_linker",
        "linker_extra_config": {"urls": [...], "replication": 1, "tenant": "", ...}}'

(:func:`linker_args` builds them from :class:`banaserve.config.store_options.KvStoreOptions`,
whose ``from_extra`` reads them back). The token comes from ``BANASERVE_KV_STORE_TOKEN`` (or
``token`` in the extra config).

Keys: the tree hands the linker SGLang's chained per-page storage hashes; the store key
namespaces each by model, KV layout, tensor/pipeline-parallel rank and tenant exactly as
:class:`banaserve.sglang_ext.kvstore_backend.BanaServeKvStore` does, and page bytes follow
:class:`banaserve.kvstore.keys.KvLayout` (layer-major, K then V), so the two share pages when
their model names and hashes agree.

Lookups claim: the missing pages are claimed for this instance, which computes and stores them,
and a lookup on another instance waits (up to ``lookup_wait_s``, 1 s by default) for claimed
pages to arrive. That is what makes a prefill -> decode handoff hit: the decode's lookup may
come before the prefill's offload has landed. An instance never waits for its own claims.
A request aborted before it computes its pages releases the claims its lookups took
(:mod:`banaserve.sglang_ext.abort_release`), so that no other instance waits for them.

Loads (:mod:`banaserve.sglang_ext.linker_load`): every batch that restores pages gets one
gated layer pipeline fed by a reader thread, so the store read of later layers overlaps the
forward's compute of earlier ones. Offloads (:mod:`banaserve.sglang_ext.linker_offload`): the
forward's own write of each layer starts that layer's copy to host, and a background thread
PUTs the pages.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import _mha_device_pool_entry
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from banaserve.config.store_options import (
    DEFAULT_LOAD_DEPTH,
    DEFAULT_LOOKUP_WAIT_S,
    KvStoreOptions,
)
from banaserve.sglang_ext.layer_store import LayerWiseStore
from banaserve.sglang_ext.linker_kv import DeviceKv, device_kv_of, new_stats
from banaserve.sglang_ext.linker_load import BanaServeLayerCounter, LayerLoader
from banaserve.sglang_ext.linker_offload import Offloader
from banaserve.sglang_ext.store_attachment import RankIdentity, StoreAttachment, open_client

__all__ = ["BanaServeLayerCounter", "BanaServeLinker", "linker_args"]

logger = logging.getLogger(__name__)


def linker_args(options: KvStoreOptions, urls: Sequence[str]) -> list[str]:
    """SGLang flags that attach an instance to the store at ``urls`` through this linker."""
    config = {
        "linker": BanaServeLinker.__name__,
        "linker_module_path": __name__,
        "linker_extra_config": options.to_extra(urls),
    }
    return [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend", "dynamic",
        "--unified-cache-external-linker-config", json.dumps(config),
    ]  # fmt: skip


class BanaServeLinker(UnifiedCacheLinker):
    """Direct device <-> BanaServe KV store linker (MHA models only).

    Owns: its :class:`StoreAttachment` (client, namespace, claims), the layer-wise store (host
    copies of freshly computed layers), its :class:`LayerLoader` (per started load batch a
    staging buffer and a reader thread, joined in :meth:`finish_layer_wise_loading`) and its
    :class:`Offloader` (one thread). The device
    KV rows are SGLang's; the linker writes only rows SGLang handed it in ``load`` and reads
    only rows handed it in ``offload``.

    Threads: SGLang calls every public method on its scheduler thread, and the KV pool's
    layer wait hook (:class:`BanaServeLayerCounter`) on the forward's. ``pending_loads`` is
    confined to the scheduler thread; the counter's batches are under its lock, each batch's
    progress under its condition; offloads reach the offload thread through a queue.

    Blocking: ``lookup`` blocks the scheduler for one store round trip and up to
    ``lookup_wait_s`` for pages another instance is storing; the forward blocks in
    ``wait_until`` for its layer's fetch only; ``finish_layer_wise_loading`` joins the batch's
    reader; ``reset`` and ``close`` wait for every queued offload.
    """

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any,
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ) -> None:
        options = KvStoreOptions.from_extra(dict(extra_config or {}))
        page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        if set(components) - {ComponentType.FULL} or not hasattr(kvcache, "k_buffer"):
            raise ValueError(
                "BanaServeLinker supports plain MHA KV pools only, got "
                f"{type(kvcache).__name__} with components {sorted(map(str, components))}"
            )
        num_layers = len(kvcache.k_buffer)
        # SGLang 0.5.23 builds no direct-linker pool group for a plain MHA pool
        # (_PlainKvStrategy), so the linker describes the pool itself.
        entry = _mha_device_pool_entry(
            PoolName.KV, kvcache, {layer: layer for layer in range(num_layers)}, page_size
        )
        self.pools = {PoolName.KV: entry}
        if entry.layer_mapping != {
            layer: (layer, num_layers + layer) for layer in range(num_layers)
        }:
            raise ValueError("BanaServeLinker needs one K and one V buffer per layer")
        kv = device_kv_of(list(kvcache.k_buffer), list(kvcache.v_buffer), page_size,
                          forward_stream)  # fmt: skip
        layer_store = LayerWiseStore(
            kv.k_buffers,
            kv.v_buffers,
            page_size=page_size,
            row_bytes=kv.row_bytes,
            device=kv.pipeline_device,
            stream=kv.compute_stream,
            budget_bytes=options.layer_store_bytes,
            start_layer=int(getattr(kvcache, "start_layer", 0) or 0),
        )
        layer_store.attach(kvcache)

        tp_rank, tp_size = 0, 1
        tp_group = getattr(params, "attn_tp_cache_group", None) or getattr(
            params, "tp_cache_group", None
        )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            tp_rank = torch.distributed.get_rank(group=tp_group)
            tp_size = torch.distributed.get_world_size(group=tp_group)
        model_name = getattr(server_args, "served_model_name", None) or getattr(
            server_args, "model_path", ""
        )
        pp_rank = int(getattr(params, "pp_rank", 0) or 0)
        pp_size = int(getattr(params, "pp_size", 1) or 1)
        rank = RankIdentity(model_name, (tp_rank, tp_size), (pp_rank, pp_size), options.tenant)
        store = StoreAttachment(
            open_client(options, "BanaServeLinker (linker_extra_config)"),
            rank,
            kv.layout,
            # One owner per instance, not per request: a lookup runs on the scheduler thread,
            # which must never wait for a page that only its own next batch will compute.
            owner=f"{socket.gethostname()}:{os.getpid()}:linker:{tp_rank}",
        )
        self._assemble(
            kv,
            store,
            layer_store=layer_store,
            depth=options.load_depth,
            lookup_wait_s=options.lookup_wait_s,
            name=f"tp{tp_rank}",
        )
        logger.info(
            "BanaServe linker: %d layers, page %d tokens, %d B/layer/page, model %r tp %d/%d, "
            "urls %s",
            num_layers,
            page_size,
            kv.layout.layer_bytes,
            model_name,
            tp_rank,
            tp_size,
            store.client.urls,
        )

    @classmethod
    def assembled(
        cls,
        kv: DeviceKv,
        store: StoreAttachment,
        *,
        layer_store: LayerWiseStore,
        depth: int = DEFAULT_LOAD_DEPTH,
        lookup_wait_s: float = DEFAULT_LOOKUP_WAIT_S,
        name: str = "tp0",
    ) -> BanaServeLinker:
        """A linker over ``kv`` from its parts, without SGLang's KV pool (a test's tensors);
        ``load`` needs SGLang's pool description, the rest does not."""
        linker = cls.__new__(cls)
        linker._assemble(kv, store, layer_store=layer_store, depth=depth,
                         lookup_wait_s=lookup_wait_s, name=name)  # fmt: skip
        return linker

    def _assemble(
        self,
        kv: DeviceKv,
        store: StoreAttachment,
        *,
        layer_store: LayerWiseStore,
        depth: int,
        lookup_wait_s: float,
        name: str,
    ) -> None:
        self.kv = kv
        self.page_size = kv.page_size
        self.num_layers = kv.num_layers
        self.store = store
        self.layer_store = layer_store
        self.lookup_wait_s = lookup_wait_s
        self.stats = new_stats()
        self.loader = LayerLoader(kv, store, depth, self.stats)
        self.layer_done_counter = self.loader.counter
        self.pending_loads: dict[str, list[PoolTransfer]] = {}
        self.offloader = Offloader(kv, store, self.stats, f"banaserve-offload-{name}")

    # -- keys ----------------------------------------------------------------------------

    @staticmethod
    def _kv(transfers: Sequence[PoolTransfer]) -> PoolTransfer | None:
        return next((t for t in transfers if t.name == PoolName.KV), None)

    def _rows(self, indices: torch.Tensor) -> list[int]:
        """First token row of each page of ``indices`` (device token slots, page-aligned)."""
        return self.pools[PoolName.KV].prepare_locations(indices)

    # -- lookup / load -------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = self._kv(transfers)
        if kv is None or not kv.keys:
            return []
        try:
            hit = self.store.claiming_lookup(rid, self.store.keys(kv.keys), self.lookup_wait_s)
        except Exception:  # the store is an optimisation: an error is a miss
            logger.exception("BanaServe linker lookup failed")
            return []
        if hit:
            self.stats["lookup_hits"] += 1
            logger.debug("BanaServe linker lookup: rid=%s pages=%d", rid, hit)
        return list(range(1, hit + 1))

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = self._kv(transfers)
        if kv is None or not kv.keys or kv.device_indices is None:
            return False
        if len(kv.device_indices) != len(kv.keys) * self.page_size:
            return False
        if rid in self.pending_loads:
            raise RuntimeError(f"BanaServe load for rid={rid} is already queued")
        self.pending_loads[rid] = [kv]
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending_loads.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        pending, self.pending_loads = self.pending_loads, {}
        keys: list[str] = []
        rows: list[int] = []
        for transfers in pending.values():
            kv = transfers[0]
            keys.extend(kv.keys)
            rows.extend(self._rows(kv.device_indices))
        self.layer_store.forget_pages(rows)  # the load overwrites these pages' rows
        return self.loader.start(self.store.keys(keys), rows)

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.loader.finish(counter_index)

    # -- offload -------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        kv = self._kv(transfers)
        if kv is None or not kv.keys:
            return False
        indices = kv.device_indices if kv.device_indices is not None else kv.host_indices
        if indices is None or len(indices) != len(kv.keys) * self.page_size:
            return False
        kv = PoolTransfer(name=PoolName.KV, device_indices=indices, keys=list(kv.keys))
        # Resolved on the scheduler thread, before a later forward can remap these pages.
        captured = self.layer_store.resolve(indices)
        self.offloader.submit(kv, captured, self.record_offload_ready())
        return True

    def num_completed_offloads(self) -> int:
        return self.offloader.num_completed()

    def pop_completed_offload(self) -> bool:
        return self.offloader.pop_completed()

    # -- lifecycle -----------------------------------------------------------------------

    def reset(self) -> None:
        self.pending_loads.clear()
        self.loader.reset()
        self.offloader.drain()

    def close(self) -> None:
        self.pending_loads.clear()
        self.loader.reset()
        self.offloader.close()
        logger.info(
            "BanaServe linker stats: %s; layer-wise store: %s", self.stats, self.layer_store.stats
        )
        self.store.close()
