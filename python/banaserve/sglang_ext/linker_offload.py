"""The offload half of the external linker: pages SGLang hands it go to the store on a
background thread.

The forward's own write of each layer's KV starts that layer's copy to host
(:class:`banaserve.sglang_ext.layer_store.LayerWiseStore`, the pipeline's store stage, so the
copies overlap the later layers' compute); the linker resolves which pages were captured and
:meth:`Offloader.submit` queues them; the thread PUTs the pages the store lacks. Pages not
captured (written by another kind of forward, or since) are gathered from the device rows on
that thread instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from queue import Empty, Queue
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolTransfer

from banaserve.sglang_ext.linker_kv import LOG_FIRST_LOADS, DeviceKv

if TYPE_CHECKING:
    from banaserve.sglang_ext.store_attachment import StoreAttachment

logger = logging.getLogger("banaserve.sglang_ext.kvstore_linker")

#: One queued offload: the pages, their captured host copies, the events to wait for first.
Task = tuple[PoolTransfer, Sequence[torch.Tensor | None], Sequence[Any]]


class Offloader:
    """PUTs offloaded pages on its own thread, started here and ended by :meth:`close`.

    :meth:`submit`, :meth:`drain` and the completion calls are made on SGLang's scheduler
    thread; the queue and the results queue are the only state the two threads share.
    ``attachment`` is the linker's (it maps SGLang's page hashes to store keys);
    ``stats`` is the linker's (the offload counters are written on this thread). The thread
    blocks on the store; :meth:`drain` and :meth:`close` block until every queued offload is
    done.
    """

    def __init__(
        self, kv: DeviceKv, attachment: StoreAttachment, stats: dict[str, int], name: str
    ) -> None:
        self.kv = kv
        self.attachment = attachment
        self.stats = stats
        self._offloads = 0
        self.queue: Queue[Task | None] = Queue()
        self.results: Queue[bool] = Queue()
        self.thread = threading.Thread(target=self._offload_loop, daemon=True, name=name)
        self.thread.start()

    def submit(self, kv: PoolTransfer, captured: Sequence[torch.Tensor | None],
               ready_events: Sequence[Any]) -> None:  # fmt: skip
        """Queue ``kv``'s pages; the thread waits for ``ready_events`` before reading them."""
        self.queue.put((kv, captured, ready_events))

    def num_completed(self) -> int:
        return self.results.qsize()

    def pop_completed(self) -> bool:
        return self.results.get_nowait()

    def drain(self) -> None:
        """Wait for every queued offload, and drop their results."""
        self.queue.join()
        while True:
            try:
                self.results.get_nowait()
            except Empty:
                break

    def close(self) -> None:
        self.drain()
        self.queue.put(None)
        self.thread.join()

    def _offload_loop(self) -> None:
        while True:
            task = self.queue.get()
            try:
                if task is None:
                    return
                kv, captured, ready_events = task
                for event in ready_events:
                    event.synchronize()
                self.results.put(self.store(kv, captured))
            except Exception:
                logger.exception("BanaServe linker offload failed")
                self.results.put(False)
            finally:
                self.queue.task_done()

    def store(self, kv: PoolTransfer, captured: Sequence[torch.Tensor | None] = ()) -> bool:
        """PUT the pages of ``kv`` the store lacks: ``captured[p]`` where the forward's
        layer-wise copy holds page p, else gathered from the device rows."""
        keys = self.attachment.keys(kv.keys)
        present = self.attachment.client.exists(keys)
        todo = [p for p, ok in enumerate(present) if not ok]
        if not todo:
            return True
        buffers = {p: captured[p] if p < len(captured) else None for p in todo}
        from_capture = sum(b is not None for b in buffers.values())
        gather = [p for p in todo if buffers[p] is None]
        if gather:
            host = self.gather(kv.device_indices.reshape(-1, self.kv.page_size)[gather].reshape(-1))
            for i, p in enumerate(gather):
                buffers[p] = host[i]
        stored = self.attachment.put([keys[p] for p in todo], [buffers[p] for p in todo])
        self.stats["offloaded_pages"] += sum(stored)
        self.stats["offloaded_from_capture"] += from_capture
        self._offloads += 1
        log = logger.info if self._offloads <= LOG_FIRST_LOADS else logger.debug
        log(
            "BanaServe linker offload: %d pages stored, %d from the layer-wise capture",
            sum(stored),
            from_capture,
        )
        return all(stored)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Store pages (uint8 ``[pages, layers, 2, page bytes]``) of whole-page ``slots``."""
        pages = len(slots) // self.kv.page_size
        slots = slots.to(self.kv.device, dtype=torch.int64)
        host = torch.empty((pages, self.kv.num_layers, 2, self.kv.half_bytes), dtype=torch.uint8)
        for layer in range(self.kv.num_layers):
            for side, buffer in enumerate((self.kv.k_buffers[layer], self.kv.v_buffers[layer])):
                rows = buffer.index_select(0, slots).view(torch.uint8).reshape(pages, -1)
                host[:, layer, side].copy_(rows)
        return host
