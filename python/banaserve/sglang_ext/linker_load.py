"""The load half of the external linker: pages from the store into the device rows, layer by
layer, behind the forward.

Every batch that restores pages gets one gated :class:`LayerPipeline`. A reader thread pulls
layer i of every page of the batch from the store into host staging slot ``i % depth``
(``client.get_layers``) and announces it with ``source_ready(i)``; the pipeline copies the slot
into the pages' device rows. The forward reaches layer l through the KV pool's
``wait_until(l)`` (:class:`BanaServeLayerCounter`), which marks layer l-1 computed and waits
for layer l's fetch only, so the store read of later layers overlaps the compute of earlier
ones. A miss or error fails the batch (``source_failed``); the forward is never interrupted and
:meth:`LayerLoader.finish` reports the failure, so SGLang aborts the loading requests.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from banaserve.sglang_ext.linker_kv import LOG_FIRST_LOADS, DeviceKv

if TYPE_CHECKING:
    from banaserve.sglang_ext.store_attachment import StoreAttachment

logger = logging.getLogger("banaserve.sglang_ext.kvstore_linker")


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


class LayerLoader:
    """Starts, drives and finishes the load batches of one linker.

    Owns each started batch's staging buffer, pipeline and reader thread until :meth:`finish`
    joins and frees them. Called on SGLang's scheduler thread (:meth:`start`, :meth:`finish`,
    :meth:`reset`); the forward thread reaches a batch through :attr:`counter` only. The
    reader threads block on the store; :meth:`finish` blocks until its batch's reader ends.
    ``stats`` is the linker's (the ``load`` counters are written here).
    """

    def __init__(
        self, kv: DeviceKv, attachment: StoreAttachment, depth: int, stats: dict[str, int]
    ) -> None:
        self.kv = kv
        self.attachment = attachment
        self.depth = max(1, depth)
        self.stats = stats
        self.counter = BanaServeLayerCounter(kv.num_layers)

    def start(self, keys: list[bytes], rows: list[int]) -> int:
        """Start loading the pages ``keys`` into the device pages whose first rows are
        ``rows``; the batch's counter index. A batch that cannot start is failed at once (its
        :meth:`finish` reports it) rather than raising into the scheduler."""
        batch = self.counter.new_batch()
        try:
            self.start_batch(batch, keys, rows)
        except Exception as error:
            logger.exception("BanaServe linker could not start a load")
            batch.fail(str(error))
            batch.next_layer = batch.num_layers  # nothing to wait for
        self.stats["loaded_pages"] += len(keys)
        return batch.index

    def start_batch(self, batch: _LoadBatch, keys: list[bytes], rows: list[int]) -> None:
        from banaserve.pipeline.layer_pipeline import LayerPipeline

        pages, depth, half = len(keys), min(self.depth, self.kv.num_layers), self.kv.half_bytes
        staging = np.empty((depth, pages, 2 * half), dtype=np.uint8)
        base = staging.ctypes.data
        fetch = []
        for layer in range(self.kv.num_layers):
            slot = base + (layer % depth) * pages * 2 * half
            k_base = self.kv.k_buffers[layer].data_ptr()
            v_base = self.kv.v_buffers[layer].data_ptr()
            segments = []
            for p, row in enumerate(rows):
                src = slot + p * 2 * half
                segments.append((src, k_base + row * self.kv.row_bytes, half))
                segments.append((src + half, v_base + row * self.kv.row_bytes, half))
            fetch.append(segments)
        batch.staging = staging
        batch.pages = pages
        batch.pipeline = LayerPipeline(
            self.kv.num_layers,
            fetch=fetch,
            depth=depth,
            device=self.kv.pipeline_device,
            stream=self.kv.compute_stream,
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
        for layer in range(self.kv.num_layers):
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
                found = self.attachment.get_layers(
                    keys, layer, layer + 1, [slot[p] for p in range(len(keys))]
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

    def finish(self, counter_index: int) -> bool:
        """End the batch: fetch what the forward did not wait on, join its reader; whether
        every page loaded."""
        batch = self.counter.pop(counter_index)
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
        log = logger.info if self.stats["load_batches"] <= LOG_FIRST_LOADS else logger.debug
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

    def reset(self) -> None:
        """Finish every batch still started, and forget the counter's indices."""
        for index in list(self.counter.batches):
            self.finish(index)
        self.counter.reset()
