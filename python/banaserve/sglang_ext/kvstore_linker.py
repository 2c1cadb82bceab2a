"""SGLang unified-cache external linker that loads prefix KV from BanaServe's Global KV Cache
Store layer by layer (step 2 of docs/layerwise_loading.md).

Loaded by SGLang with::

    --enable-unified-cache-external-linker
    --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "BanaServeLinker",
        "linker_module_path": "banaserve.sglang_ext.kvstore_linker",
        "linker_extra_config": {"urls": [...], "replication": 1, "tenant": ""}}'

(:func:`linker_args` builds them). The token comes from ``BANASERVE_KV_STORE_TOKEN`` (or
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

Loads: every batch that restores pages gets one gated :class:`LayerPipeline`. A reader thread
pulls layer i of every page of the batch from the store into host staging slot ``i % depth``
(``client.get_layers``) and announces it with ``source_ready(i)``; the pipeline copies the slot
into the pages' device rows. The forward reaches layer l through the KV pool's
``wait_until(l)``, which marks layer l-1 computed and waits for layer l's fetch only, so the
store read of later layers overlaps the compute of earlier ones. A miss or error fails the
batch (``source_failed``); the forward is never interrupted and ``finish`` reports the failure,
so SGLang aborts the loading requests.

Offloads: the forward's own write of each layer's KV starts that layer's copy to host
(:class:`banaserve.sglang_ext.layer_store.LayerWiseStore`, the pipeline's store stage, so the
copies overlap the later layers' compute); ``offload`` picks the captured pages and a background
thread PUTs them. Pages not captured (written by another kind of forward, or since) are
gathered from the device rows on that thread instead.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Sequence
from queue import Empty, Queue
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import _mha_device_pool_entry
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from banaserve.kvstore.keys import KvLayout, namespaced_key
from banaserve.sglang_ext import abort_release
from banaserve.sglang_ext.layer_store import DEFAULT_BUDGET_BYTES, LayerWiseStore
from banaserve.sglang_ext.store_attachment import instance_namespace, open_client

logger = logging.getLogger(__name__)

DEFAULT_DEPTH = 3
#: How long ``lookup`` waits for pages another instance is computing or storing. It runs on the
#: scheduler thread, so the bound is short: long enough for a prefill instance's offload to
#: land before the decode instance it handed off to looks the pages up (milliseconds here).
DEFAULT_LOOKUP_WAIT_S = 1.0
#: How long this instance's claims on pages it will compute hold without its PUT.
CLAIM_LEASE_S = 30.0


def linker_args(urls: Sequence[str], replication: int = 1, tenant: str = "") -> list[str]:
    """SGLang flags that attach an instance to the store at ``urls`` through this linker."""
    config = {
        "linker": BanaServeLinker.__name__,
        "linker_module_path": __name__,
        "linker_extra_config": {
            "urls": list(urls),
            "replication": replication,
            "tenant": tenant,
        },
    }
    return [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend", "dynamic",
        "--unified-cache-external-linker-config", json.dumps(config),
    ]  # fmt: skip


class _LoadBatch:
    """One started batch: its pipeline, staging slots, reader thread and progress."""

    def __init__(self, index: int, num_layers: int) -> None:
        self.index = index
        self.num_layers = num_layers
        self.pipeline: Any = None
        self.staging: np.ndarray | None = None
        self.reader: threading.Thread | None = None
        self.cond = threading.Condition()
        # Layers [0, next_layer) have been fetched (wait_fetched returned or failed).
        self.next_layer = 0
        self.failed: str | None = None
        self.stopped = False
        self.pages = 0

    def fail(self, message: str) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = message
            self.cond.notify_all()


class BanaServeLayerCounter:
    """The KV pool's layer wait hook for BanaServe loads.

    ``wait_until(l)`` marks layer l-1 computed and waits for layer l's fetch; it is idempotent
    (K and V, and several attention calls, wait on the same layer) and never raises into the
    forward: a failed batch is reported by :meth:`BanaServeLinker.finish_layer_wise_loading`.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.producer_index = -1
        self.consumer_index = -1
        self.batches: dict[int, _LoadBatch] = {}
        self._lock = threading.Lock()

    def new_batch(self) -> _LoadBatch:
        with self._lock:
            self.producer_index += 1
            batch = _LoadBatch(self.producer_index, self.num_layers)
            self.batches[batch.index] = batch
            return batch

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def get(self, index: int) -> _LoadBatch | None:
        with self._lock:
            return self.batches.get(index)

    def pop(self, index: int) -> _LoadBatch | None:
        with self._lock:
            return self.batches.pop(index, None)

    def wait_until(self, threshold: int) -> None:
        batch = self.get(self.consumer_index)
        if batch is None:
            return
        advance(batch, min(threshold, batch.num_layers - 1))

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1
        with self._lock:
            self.batches.clear()


def advance(batch: _LoadBatch, threshold: int) -> None:
    """Drive ``batch``'s pipeline so that layers [0, threshold] are fetched."""
    pipeline = batch.pipeline
    while batch.next_layer <= threshold:
        layer = batch.next_layer
        if batch.failed is None:
            try:
                if layer > 0:
                    pipeline.computed(layer - 1)
                pipeline.wait_fetched(layer)
            except Exception as error:  # a failed store read or copy
                batch.fail(str(error))
        with batch.cond:
            batch.next_layer = layer + 1
            batch.cond.notify_all()


class BanaServeLinker(UnifiedCacheLinker):
    """Direct device <-> BanaServe KV store linker (MHA models only)."""

    #: The first loads are logged at INFO (tests read them), later ones at DEBUG.
    LOG_FIRST_LOADS = 8

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any,
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ) -> None:
        extra = dict(extra_config or {})
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        if set(components) - {ComponentType.FULL} or not hasattr(kvcache, "k_buffer"):
            raise ValueError(
                "BanaServeLinker supports plain MHA KV pools only, got "
                f"{type(kvcache).__name__} with components {sorted(map(str, components))}"
            )
        self.num_layers = len(kvcache.k_buffer)
        # SGLang 0.5.23 builds no direct-linker pool group for a plain MHA pool
        # (_PlainKvStrategy), so the linker describes the pool itself.
        entry = _mha_device_pool_entry(
            PoolName.KV, kvcache, {layer: layer for layer in range(self.num_layers)}, self.page_size
        )
        self.pools = {PoolName.KV: entry}
        k_buffers = list(kvcache.k_buffer)
        v_buffers = list(kvcache.v_buffer)
        if len(k_buffers) != self.num_layers or entry.layer_mapping != {
            layer: (layer, self.num_layers + layer) for layer in range(self.num_layers)
        }:
            raise ValueError("BanaServeLinker needs one K and one V buffer per layer")
        self.k_buffers, self.v_buffers = k_buffers, v_buffers
        first = k_buffers[0]
        self.device = first.device
        dtype = str(first.dtype).removeprefix("torch.")
        self.layout = KvLayout(
            num_layers=self.num_layers,
            num_kv_heads=int(first.shape[1]),
            head_dim=int(first.shape[2]),
            dtype=dtype,
            page_size=self.page_size,
        )
        self.row_bytes = first.stride(0) * first.element_size()
        self.half_bytes = self.row_bytes * self.page_size  # K (or V) of one page, one layer
        if 2 * self.half_bytes != self.layout.layer_bytes or any(
            b.stride(0) * b.element_size() != self.row_bytes or b.dtype != first.dtype
            for b in (*k_buffers, *v_buffers)
        ):
            raise ValueError("BanaServeLinker: KV rows do not match the store's page layout")
        if self.device.type == "cuda":
            self.pipeline_device: str = f"cuda:{self.device.index or 0}"
        elif self.device.type == "cpu":
            self.pipeline_device = "cpu"
        else:
            raise ValueError(f"BanaServeLinker: unsupported KV device {self.device}")
        self.depth = max(1, int(extra.get("depth", DEFAULT_DEPTH)))
        # CUDA: the stream the forward computes on, which every copy is ordered with.
        self.compute_stream: int | None = None
        if self.pipeline_device != "cpu" and forward_stream is not None:
            self.compute_stream = int(forward_stream.cuda_stream)
        self.layer_store = LayerWiseStore(
            k_buffers,
            v_buffers,
            page_size=self.page_size,
            row_bytes=self.row_bytes,
            device=self.pipeline_device,
            stream=self.compute_stream,
            budget_bytes=int(extra.get("layer_store_bytes", DEFAULT_BUDGET_BYTES)),
            start_layer=int(getattr(kvcache, "start_layer", 0) or 0),
        )
        self.layer_store.attach(kvcache)

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
        self.tenant = str(extra.get("tenant", ""))
        self._namespace_digest = instance_namespace(
            model_name, (tp_rank, tp_size), (pp_rank, pp_size), self.layout, self.tenant
        )

        self.client = open_client(extra, "BanaServeLinker (linker_extra_config)")
        self.lookup_wait_s = float(extra.get("lookup_wait_s", DEFAULT_LOOKUP_WAIT_S))
        # One owner per instance, not per request: a lookup runs on the scheduler thread,
        # which must never wait for a page that only its own next batch will compute.
        self.owner = f"{socket.gethostname()}:{os.getpid()}:linker:{tp_rank}"
        self._ledger = abort_release.ClaimLedger(self._release_claims, CLAIM_LEASE_S)
        abort_release.register(self._ledger)
        self.layer_done_counter = BanaServeLayerCounter(self.num_layers)
        self.pending_loads: dict[str, list[PoolTransfer]] = {}
        self.offload_queue: Queue[tuple[PoolTransfer, list[torch.Tensor | None], list[Any]] | None]
        self.offload_queue = Queue()
        self.offload_results: Queue[bool] = Queue()
        self.stats = {
            "lookup_hits": 0,
            "load_batches": 0,
            "loaded_pages": 0,
            "failed_loads": 0,
            "offloaded_pages": 0,
            "offloaded_from_capture": 0,
        }
        self._offloads = 0
        self.offload_thread = threading.Thread(
            target=self._offload_loop, daemon=True, name=f"banaserve-offload-tp{tp_rank}"
        )
        self.offload_thread.start()
        logger.info(
            "BanaServe linker: %d layers, page %d tokens, %d B/layer/page, model %r tp %d/%d, "
            "urls %s",
            self.num_layers,
            self.page_size,
            self.layout.layer_bytes,
            model_name,
            tp_rank,
            tp_size,
            self.client.urls,
        )

    # -- keys ----------------------------------------------------------------------------

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return [namespaced_key(self._namespace_digest, key) for key in keys]

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
            keys = self._keys(kv.keys)
            hit = self.client.lookup(
                keys, owner=self.owner, wait_s=self.lookup_wait_s, lease_s=CLAIM_LEASE_S
            )
        except Exception:  # the store is an optimisation: an error is a miss
            logger.exception("BanaServe linker lookup failed")
            return []
        self._ledger.record(rid, keys[hit:])
        if hit:
            self.stats["lookup_hits"] += 1
            logger.debug("BanaServe linker lookup: rid=%s pages=%d", rid, hit)
        return list(range(1, hit + 1))

    def _release_claims(self, rid: str, keys: list[bytes]) -> None:
        self.client.release(keys, self.owner)

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
        batch = self.layer_done_counter.new_batch()
        try:
            self._start_batch(batch, self._keys(keys), rows)
        except Exception as error:
            logger.exception("BanaServe linker could not start a load")
            batch.fail(str(error))
            batch.next_layer = batch.num_layers  # nothing to wait for
        self.stats["loaded_pages"] += len(keys)
        return batch.index

    def _start_batch(self, batch: _LoadBatch, keys: list[bytes], rows: list[int]) -> None:
        from banaserve.pipeline.layer_pipeline import LayerPipeline

        pages, depth, half = len(keys), min(self.depth, self.num_layers), self.half_bytes
        staging = np.empty((depth, pages, 2 * half), dtype=np.uint8)
        base = staging.ctypes.data
        fetch = []
        for layer in range(self.num_layers):
            slot = base + (layer % depth) * pages * 2 * half
            k_base = self.k_buffers[layer].data_ptr()
            v_base = self.v_buffers[layer].data_ptr()
            segments = []
            for p, row in enumerate(rows):
                src = slot + p * 2 * half
                segments.append((src, k_base + row * self.row_bytes, half))
                segments.append((src + half, v_base + row * self.row_bytes, half))
            fetch.append(segments)
        batch.staging = staging
        batch.pages = pages
        batch.pipeline = LayerPipeline(
            self.num_layers,
            fetch=fetch,
            depth=depth,
            device=self.pipeline_device,
            stream=self.compute_stream,
            gated=True,
        )
        batch.reader = threading.Thread(
            target=self._read_loop,
            args=(batch, keys, depth),
            daemon=True,
            name=f"banaserve-load-{batch.index}",
        )
        batch.reader.start()

    def _read_loop(self, batch: _LoadBatch, keys: list[bytes], depth: int) -> None:
        """Store -> host staging, one layer at a time; slot ``i % depth`` is reused once the
        fetch of layer ``i - depth`` (its previous occupant) has completed."""
        pipeline, staging = batch.pipeline, batch.staging
        assert staging is not None
        for layer in range(self.num_layers):
            with batch.cond:
                while (
                    batch.next_layer < layer - depth + 1
                    and batch.failed is None
                    and not batch.stopped
                ):
                    batch.cond.wait()
                if batch.failed is not None or batch.stopped:
                    return
            slot = staging[layer % depth]
            try:
                found = self.client.get_layers(
                    keys, self.layout, layer, layer + 1, [slot[p] for p in range(len(keys))]
                )
                if not all(found):
                    raise RuntimeError(
                        f"{len(found) - sum(found)} of {len(found)} pages missing in the store"
                    )
            except Exception as error:
                message = f"layer {layer}: {error}"
                logger.warning("BanaServe linker load failed: %s", message)
                batch.fail(message)
                pipeline.source_failed(layer, message)
                return
            if not pipeline.source_ready(layer):
                return

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        batch = self.layer_done_counter.pop(counter_index)
        if batch is None:
            return True
        # Layers [0, waited) were fetched on the forward's demand through wait_until.
        waited = batch.next_layer if batch.failed is None else 0
        if batch.pipeline is not None:
            # Layers the forward did not wait on are still fetched before the slots are used.
            advance(batch, batch.num_layers - 1)
            if batch.failed is None:
                try:
                    batch.pipeline.computed(batch.num_layers - 1)
                    batch.pipeline.close()
                except Exception as error:
                    batch.fail(str(error))
            if batch.failed is not None:
                batch.pipeline.abort()
        with batch.cond:
            batch.stopped = True
            batch.cond.notify_all()
        if batch.reader is not None:
            batch.reader.join()
        batch.staging = None
        self.stats["load_batches"] += 1
        log = logger.info if self.stats["load_batches"] <= self.LOG_FIRST_LOADS else logger.debug
        log(
            "BanaServe linker load %d: %d pages, %d/%d layers waited by the forward, %s",
            counter_index,
            batch.pages,
            waited,
            batch.num_layers,
            "ok" if batch.failed is None else "failed",
        )
        if batch.failed is not None:
            self.stats["failed_loads"] += 1
            logger.error("BanaServe linker load %d failed: %s", counter_index, batch.failed)
            return False
        return True

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
        self.offload_queue.put((kv, captured, self.record_offload_ready()))
        return True

    def _offload_loop(self) -> None:
        while True:
            task = self.offload_queue.get()
            try:
                if task is None:
                    return
                kv, captured, ready_events = task
                for event in ready_events:
                    event.synchronize()
                self.offload_results.put(self._store(kv, captured))
            except Exception:
                logger.exception("BanaServe linker offload failed")
                self.offload_results.put(False)
            finally:
                self.offload_queue.task_done()

    def _store(self, kv: PoolTransfer, captured: Sequence[torch.Tensor | None] = ()) -> bool:
        """PUT the pages of ``kv`` the store lacks: ``captured[p]`` where the forward's
        layer-wise copy holds page p, else gathered from the device rows."""
        keys = self._keys(kv.keys)
        present = self.client.exists(keys)
        todo = [p for p, ok in enumerate(present) if not ok]
        if not todo:
            return True
        buffers = {p: captured[p] if p < len(captured) else None for p in todo}
        from_capture = sum(b is not None for b in buffers.values())
        gather = [p for p in todo if buffers[p] is None]
        if gather:
            host = self._gather(kv.device_indices.reshape(-1, self.page_size)[gather].reshape(-1))
            for i, p in enumerate(gather):
                buffers[p] = host[i]
        stored = self.client.put([keys[p] for p in todo], [buffers[p] for p in todo])
        self.stats["offloaded_pages"] += sum(stored)
        self.stats["offloaded_from_capture"] += from_capture
        self._offloads += 1
        log = logger.info if self._offloads <= self.LOG_FIRST_LOADS else logger.debug
        log(
            "BanaServe linker offload: %d pages stored, %d from the layer-wise capture",
            sum(stored),
            from_capture,
        )
        return all(stored)

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Store pages (uint8 ``[pages, layers, 2, page bytes]``) of whole-page ``slots``."""
        pages = len(slots) // self.page_size
        slots = slots.to(self.device, dtype=torch.int64)
        host = torch.empty((pages, self.num_layers, 2, self.half_bytes), dtype=torch.uint8)
        for layer in range(self.num_layers):
            for side, buffer in enumerate((self.k_buffers[layer], self.v_buffers[layer])):
                rows = buffer.index_select(0, slots).view(torch.uint8).reshape(pages, -1)
                host[:, layer, side].copy_(rows)
        return host

    def num_completed_offloads(self) -> int:
        return self.offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self.offload_results.get_nowait()

    # -- lifecycle -----------------------------------------------------------------------

    def reset(self) -> None:
        self.pending_loads.clear()
        for index in list(self.layer_done_counter.batches):
            self.finish_layer_wise_loading(index)
        self.offload_queue.join()
        while True:
            try:
                self.offload_results.get_nowait()
            except Empty:
                break
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        self.offload_queue.put(None)
        self.offload_thread.join()
        logger.info(
            "BanaServe linker stats: %s; layer-wise store: %s", self.stats, self.layer_store.stats
        )
        self.client.close()
