"""Layer-wise write-back: the KV rows a forward writes leave the device one layer at a time,
while the forward computes the later layers (the store stage of DESIGN.md mechanism 3).

:class:`LayerWiseStore` wraps the KV pool's ``set_kv_buffer``. A forward that writes at least
one whole page (an extend; a decode step writes one token per request) opens a store-only
:class:`~banaserve.pipeline.layer_pipeline.LayerPipeline` over those whole pages: once layer l's
rows are written, ``computed(l)`` lets a pipeline worker copy them into a host buffer while
layers l+1.. compute. The last layer's write closes the pipeline (the forward waits for that
one layer's copy only), so no copy still reads device rows that a later forward or a load may
reuse.

The host buffer is page-major, ``[pages, layers, K|V, page rows, row bytes]``: exactly a store
page in :class:`banaserve.kvstore.keys.KvLayout` order, so a captured page is PUT without
another copy. :meth:`LayerWiseStore.resolve` maps the device pages of an offload to their
captured bytes; pages written since (by a later forward, a load, or any other writer of the
pool) are no longer captured, and the offload gathers them from the device as before.

Threading: ``set_kv_buffer``, :meth:`resolve` and :meth:`forget_pages` run on the scheduler's
forward thread; one lock guards the page tables anyway (SGLang's overlap scheduler may resolve
while another thread launches a forward). The tensors :meth:`resolve` returns are owned by the
caller from then on (a reference keeps an evicted capture's memory alive).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from banaserve.config.store_options import DEFAULT_LAYER_STORE_BYTES
from banaserve.pipeline.layer_pipeline import COMPUTE, STORE, LayerPipeline

logger = logging.getLogger(__name__)

#: Captures kept for offloads still to come (the newest ones).
MAX_CAPTURES = 8
#: The first captures are logged at INFO (tests read them), later ones at DEBUG.
LOG_FIRST = 8
#: KV pool methods (SGLang 0.5.23) that write rows without ``set_kv_buffer``, with the index of
#: their slot argument: a retracted request's reload, a KV move, a speculative partial write.
OTHER_WRITERS = {"load_cpu_copy": 1, "move_kv_cache": 0, "set_kv_buffer_prefix_valid": 1}


@dataclass
class Capture:
    """The whole pages one forward wrote, copied to host layer by layer."""

    forward_id: int
    pages: np.ndarray  # device page ids (slot // page_size), in capture order
    host: torch.Tensor  # uint8 [pages, layers, 2, page rows, row bytes]
    pipeline: LayerPipeline | None
    next_layer: int = 0
    # Layers whose copy had ended when the forward wrote the last layer (overlap, for logs).
    stored_during_forward: int = 0
    # The pipeline's timestamps (see LayerPipeline.timestamps), once complete.
    stamps: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.host.numel()


@dataclass
class LayerStoreStats:
    captured_forwards: int = 0
    captured_pages: int = 0
    skipped_over_budget: int = 0
    dropped: int = 0
    layers_stored_during_forward: list[int] = field(default_factory=list)


def whole_pages(loc: np.ndarray, page_size: int) -> np.ndarray:
    """Indices i of ``loc`` where ``loc[i:i + page_size]`` is one whole device page, in order:
    page-aligned and consecutive slots."""
    n = len(loc)
    if n < page_size:
        return np.empty(0, dtype=np.int64)
    starts = np.flatnonzero(loc[: n - page_size + 1] % page_size == 0)
    if page_size == 1:
        return starts
    step = np.concatenate(([0], np.cumsum(np.diff(loc) == 1)))  # step[j]: runs of +1 up to j
    return starts[step[starts + page_size - 1] - step[starts] == page_size - 1]


class LayerWiseStore:
    """Captures each forward's whole pages layer by layer (see the module docstring).

    Owns the captures' host buffers (within ``budget_bytes``; the oldest go first) and one
    store-only pipeline per capturing forward; the KV buffers are the pool's. Page tables
    under one lock; the forward blocks only for its last layer's copy.

    Args:
        k_buffers, v_buffers: the KV pool's per-layer buffers, rows of ``row_bytes``.
        page_size: tokens per page (store pages are whole device pages).
        device: the pipeline device ("cpu" or "cuda:N").
        stream: CUDA only, the forward's stream (``torch.cuda.Stream.cuda_stream``), else None.
        budget_bytes: host memory all captures may hold together; 0 disables capturing.
        start_layer: the pool's first layer id (pipeline parallelism).
    """

    def __init__(
        self,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        *,
        page_size: int,
        row_bytes: int,
        device: str,
        stream: int | None = None,
        budget_bytes: int = DEFAULT_LAYER_STORE_BYTES,
        start_layer: int = 0,
    ) -> None:
        self.k_buffers, self.v_buffers = list(k_buffers), list(v_buffers)
        self.num_layers = len(self.k_buffers)
        self.page_size, self.row_bytes = page_size, row_bytes
        self.device, self.stream = device, stream
        self.budget_bytes = budget_bytes
        self.start_layer = start_layer
        self.page_bytes = self.num_layers * 2 * page_size * row_bytes
        num_pages = -(-int(self.k_buffers[0].shape[0]) // page_size)
        # Per device page: the capture holding its bytes (-1: none) and its index there.
        self._page_capture = np.full(num_pages, -1, dtype=np.int64)
        self._page_index = np.zeros(num_pages, dtype=np.int64)
        self._captures: OrderedDict[int, Capture] = OrderedDict()
        self._open: Capture | None = None
        self._next_id = 0
        self._lock = threading.Lock()
        self.stats = LayerStoreStats()

    # -- the forward's side ----------------------------------------------------------------

    def attach(self, pool: Any) -> None:
        """Hook the KV ``pool``: its ``set_kv_buffer`` captures, and its other writers
        (:data:`OTHER_WRITERS`) unmap the pages they write. Instance attributes shadow the
        class's methods, so every attention backend writing through this pool is seen."""
        pool.set_kv_buffer = self.wrap(pool.set_kv_buffer)
        for name, slot_arg in OTHER_WRITERS.items():
            method = getattr(pool, name, None)
            if method is not None:
                setattr(pool, name, self._unmapping(method, slot_arg))

    def _unmapping(self, method: Callable[..., Any], slot_arg: int) -> Callable[..., Any]:
        def unmapping_write(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if len(args) > slot_arg and isinstance(args[slot_arg], torch.Tensor):
                self._drop_open()  # conservative: the forward being captured may be affected
                self._invalidate(args[slot_arg])
            else:
                self._unmap(slice(None))
            return result

        return unmapping_write

    def wrap(self, set_kv_buffer: Callable[..., Any]) -> Callable[..., Any]:
        """``set_kv_buffer`` of the pool, capturing after each write (same signature)."""

        def capturing_set_kv_buffer(
            layer: Any, loc_info: Any, cache_k: Any, cache_v: Any, *args: Any, **kwargs: Any
        ) -> Any:
            result = set_kv_buffer(layer, loc_info, cache_k, cache_v, *args, **kwargs)
            layer_id = kwargs.get("layer_id_override")
            if layer_id is None:
                layer_id = layer.layer_id
            loc = getattr(loc_info, "loc", loc_info)  # a KVWriteLoc or a bare tensor
            try:
                self.written(int(layer_id) - self.start_layer, loc)
            except Exception:  # capturing is an optimisation: never fail the forward
                logger.exception("BanaServe layer-wise store failed; falling back to gathers")
                self._drop_open()
            return result

        return capturing_set_kv_buffer

    def written(self, layer: int, loc: torch.Tensor) -> None:
        """Layer ``layer``'s rows at slots ``loc`` are written (on the forward's stream)."""
        if layer == 0:
            self._drop_open()  # a forward that never reached its last layer
            self._begin(loc)
        capture = self._open
        if capture is None:
            return
        if layer != capture.next_layer or capture.pipeline is None:
            logger.warning(
                "BanaServe layer-wise store: layer %d written, expected %d; capture dropped",
                layer,
                capture.next_layer,
            )
            self._drop_open()
            return
        capture.pipeline.wait_fetched(layer)  # no fetch stage: returns at once
        capture.pipeline.computed(layer)
        capture.next_layer = layer + 1
        if layer == self.num_layers - 1:
            self._finish(capture)

    def _begin(self, loc: torch.Tensor) -> None:
        if self.budget_bytes <= 0 or loc.numel() < self.page_size:
            self._invalidate(loc)
            return
        loc_np = loc.detach().to("cpu", torch.int64).numpy()
        starts = whole_pages(loc_np, self.page_size)
        pages = loc_np[starts] // self.page_size
        self._unmap(np.unique(loc_np // self.page_size))
        if not len(pages):
            return
        nbytes = len(pages) * self.page_bytes
        if nbytes > self.budget_bytes:
            self.stats.skipped_over_budget += 1
            return
        self._evict(self.budget_bytes - nbytes)
        host = torch.empty(
            (len(pages), self.num_layers, 2, self.page_size, self.row_bytes), dtype=torch.uint8
        )
        half = self.page_size * self.row_bytes
        base, layer_bytes = host.data_ptr(), 2 * half
        store = []
        for layer in range(self.num_layers):
            k_base = self.k_buffers[layer].data_ptr()
            v_base = self.v_buffers[layer].data_ptr()
            segments = []
            for p, page in enumerate(pages):
                dst = base + (p * self.num_layers + layer) * layer_bytes
                src = int(page) * half
                segments.append((k_base + src, dst, half))
                segments.append((v_base + src, dst + half, half))
            store.append(segments)
        capture = Capture(self._next_id, pages, host, None)
        self._next_id += 1
        capture.pipeline = LayerPipeline(
            self.num_layers, store=store, depth=min(3, self.num_layers), device=self.device,
            stream=self.stream,
        )  # fmt: skip
        self._open = capture

    def _finish(self, capture: Capture) -> None:
        pipeline = capture.pipeline
        assert pipeline is not None
        self._open = None
        pipeline.close()  # waits for the last layer's copy
        capture.pipeline = None
        stamps = capture.stamps = pipeline.timestamps()
        ends, last_computed = stamps[:, STORE, 1], stamps[-1, COMPUTE, 1]
        capture.stored_during_forward = int((ends <= last_computed).sum())
        with self._lock:
            self._captures[capture.forward_id] = capture
            self._page_capture[capture.pages] = capture.forward_id
            self._page_index[capture.pages] = np.arange(len(capture.pages))
        self.stats.captured_forwards += 1
        self.stats.captured_pages += len(capture.pages)
        self.stats.layers_stored_during_forward.append(capture.stored_during_forward)
        del self.stats.layers_stored_during_forward[:-64]
        log = logger.info if self.stats.captured_forwards <= LOG_FIRST else logger.debug
        log(
            "BanaServe layer-wise store: forward %d, %d pages, %d/%d layers stored during the "
            "forward, which then waited %.2f ms for the last",
            capture.forward_id,
            len(capture.pages),
            capture.stored_during_forward,
            self.num_layers,
            max(0, int(stamps[-1, STORE, 1] - last_computed)) / 1e6,
        )

    def _drop_open(self) -> None:
        capture, self._open = self._open, None
        if capture is not None and capture.pipeline is not None:
            capture.pipeline.abort()
            self.stats.dropped += 1
            self._unmap(capture.pages)

    def _invalidate(self, loc: torch.Tensor) -> None:
        """A forward not captured (or another writer) overwrites the pages it writes to."""
        if not self._captures or loc.numel() == 0:
            return
        self._unmap(np.unique(loc.detach().to("cpu", torch.int64).numpy() // self.page_size))

    def _unmap(self, pages: np.ndarray | slice) -> None:
        """These device pages no longer hold what any capture copied."""
        with self._lock:
            self._page_capture[pages] = -1

    def _evict(self, keep_bytes: int) -> None:
        with self._lock:
            held = sum(c.nbytes for c in self._captures.values())
            while self._captures and (held > keep_bytes or len(self._captures) >= MAX_CAPTURES):
                _, old = self._captures.popitem(last=False)
                held -= old.nbytes
                stale = old.pages[self._page_capture[old.pages] == old.forward_id]
                self._page_capture[stale] = -1

    # -- the offload's side ----------------------------------------------------------------

    def forget_pages(self, first_rows: Sequence[int]) -> None:
        """Pages about to be overwritten outside ``set_kv_buffer`` (a load from the store)."""
        if first_rows:
            self._unmap(np.asarray(first_rows, dtype=np.int64) // self.page_size)

    def resolve(self, device_indices: torch.Tensor) -> list[torch.Tensor | None]:
        """For each page of ``device_indices`` (token slots, whole pages in order), its
        captured bytes (a ``[layers, 2, page rows, row bytes]`` uint8 view, the store page), or
        None where the page was not captured or was written since."""
        slots = device_indices.detach().to("cpu", torch.int64).numpy().reshape(-1, self.page_size)
        first = slots[:, 0]
        aligned = (first % self.page_size == 0) & (
            (slots - first[:, None]) == np.arange(self.page_size)
        ).all(axis=1)
        out: list[torch.Tensor | None] = []
        with self._lock:
            for page, ok in zip(first // self.page_size, aligned, strict=True):
                capture = self._captures.get(int(self._page_capture[page])) if ok else None
                out.append(None if capture is None else capture.host[int(self._page_index[page])])
        return out
