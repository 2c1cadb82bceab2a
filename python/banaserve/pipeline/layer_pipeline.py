"""Python face of the C++ layer-wise three-stage pipeline (csrc/transfer/).

For L layers the pipeline overlaps, per step, the fetch of layer i+1 (host to device), the
caller's compute of layer i and the store of layer i-1 (device to host). The copies run in C++
worker threads (CPU) or on CUDA streams ordered by events (CUDA); Python only drives compute::

    with LayerPipeline(L, fetch=[(host_kv[i], dev_kv[i % 3]) for i in range(L)],
                       store=[(dev_out[i % 3], host_out[i]) for i in range(L)], depth=3) as p:
        for i in p.layers():       # waits for layer i's fetch only, not for all layers
            compute(i)             # the store of layer i starts when the loop moves on

Buffers. Every buffer is a C-contiguous numpy array, a contiguous torch tensor, or an
``(address, nbytes)`` pair. The caller owns them; the pipeline keeps a reference to each array or
tensor until it is closed, but the caller must not resize, free or (for a fetch destination or
store source) touch them out of order while the pipeline runs. A fetch destination may be
written by the pipeline at any time between the store of layer ``i - depth`` and
``wait_fetched(i)`` returning; a store source is read after ``computed(i)`` until the store ends.
So rotating ``depth`` device buffers (layer i in buffer ``i % depth``) is safe.

On CUDA, fetch destinations and store sources are device memory, the other sides host memory
(pageable is fine: the pipeline stages through its own pinned ring of ``depth`` slots), and
``wait_fetched``/``computed`` order the caller's compute stream with events instead of blocking
on the GPU.

Segments. A layer's copy may be scattered (device KV pages): instead of one (source, destination)
pair, a fetch/store entry may be a ``list`` of segments, each a (source, destination) buffer pair
of equal size or a raw ``(src_addr, dst_addr, nbytes)`` triple. On CUDA the segments of a layer
are packed into one pinned staging slot, with one ``cudaMemcpyAsync`` per segment.

Gated fetch. With ``gated=True`` the host bytes of layer i may still be arriving when the pipeline
starts (e.g. a reader thread pulling them from the KV store): layer i's fetch starts only after
``source_ready(i)`` (and the ring allows it), so the store read of layer i+1 overlaps the copy of
layer i and the compute of layer 0 can start before the last layer has arrived::

    p = LayerPipeline(L, fetch=..., depth=3, gated=True)
    # reader thread:                      # main thread:
    for i in range(L):                     for i in p.layers():
        read_from_store(i, host[i])            compute(i)
        p.source_ready(i)                  p.close()
    # on a read error: p.source_failed(i, str(err))  -> RuntimeError in the main thread
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from banaserve import _C

__all__ = ["COMPUTE", "FETCH", "STORE", "LayerPipeline", "live_threads"]

#: A buffer: numpy array, torch tensor, or (address, nbytes).
Buffer = Any
#: One segment: (source, destination) buffers of equal size, or (src_addr, dst_addr, nbytes).
Segment = tuple[Buffer, Buffer] | tuple[int, int, int]
#: One layer's copy in one direction: one segment, or a list of segments (scattered pages).
Copy = Segment | list[Segment]

#: Stage indices of :meth:`LayerPipeline.timestamps`.
FETCH, COMPUTE, STORE = 0, 1, 2
_STAGES = {"fetch": FETCH, "compute": COMPUTE, "store": STORE}


def live_threads() -> int:
    """Pipeline worker threads alive in this process, over all pipelines (for leak checks)."""
    return _C.LayerPipeline.live_threads()


def _address(buf: Buffer, what: str, writable: bool) -> tuple[int, int, str]:
    """(address, nbytes, device kind 'cpu'/'cuda') of a buffer; raises ValueError if unusable."""
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(x, int) for x in buf):
        return int(buf[0]), int(buf[1]), "raw"
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{what}: numpy array must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise ValueError(f"{what}: numpy array is read-only")
        return int(buf.__array_interface__["data"][0]), int(buf.nbytes), "cpu"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous")
        return int(buf.data_ptr()), buf.numel() * buf.element_size(), buf.device.type
    raise TypeError(
        f"{what}: expected a numpy array, torch tensor or (address, nbytes), "
        f"got {type(buf).__name__}"
    )


def _parse_device(device: str | int) -> int:
    if isinstance(device, int):
        return device
    if device == "cpu":
        return -1
    if device == "cuda":
        return 0
    if device.startswith("cuda:"):
        return int(device[5:])
    raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or an int, got {device!r}")


class LayerPipeline:
    """Fetch / compute / store over ``num_layers`` layers with at most ``depth`` in flight.

    Args:
        num_layers: L >= 1.
        fetch: None, or L pairs (host source, device destination) of equal size.
        store: None, or L pairs (device source, host destination) of equal size.
        depth: ring depth >= 1: the fetch of layer j starts only after the store of layer
            j - depth has finished, which bounds staging memory to depth slots. 3 lets one
            layer fetch, one compute and one store at the same time.
        device: "cpu" (worker threads, device memory is host memory) or "cuda[:N]".
        stream: CUDA only: the compute stream as an int (``torch.cuda.Stream.cuda_stream``);
            default: torch's current stream if torch is loaded, else the legacy default stream.
        bytes_per_second: CPU only: pace each copy to this bandwidth (sleeping, not spinning),
            to model a transfer of known duration in benchmarks; 0 copies at memcpy speed.
            A layer of several segments is paced on its total size.
        gated: if True, layer i's fetch also waits for ``source_ready(i)`` (its host bytes have
            arrived); ``source_failed`` fails the pipeline. Default False: fetches start as soon
            as the ring allows, as the host sources are complete up front.

    Each entry of ``fetch``/``store`` is one segment or a ``list`` of segments (see the module
    docstring); sizes are checked per segment (ValueError naming ``fetch[i][k]``).

    The worker threads start in the constructor. Always ``close()`` (or use ``with``):
    stage errors surface at the next ``wait_fetched``/``computed`` or at ``close``.
    """

    def __init__(
        self,
        num_layers: int,
        *,
        fetch: Sequence[Copy] | None = None,
        store: Sequence[Copy] | None = None,
        depth: int = 3,
        device: str | int = "cpu",
        stream: int | None = None,
        bytes_per_second: float = 0.0,
        gated: bool = False,
        _fault: tuple[str, int] | None = None,
    ) -> None:
        dev = _parse_device(device)
        self._keepalive: list[Buffer] = []
        fetch_t = self._copies(fetch, num_layers, "fetch", dev, device_side=1)
        store_t = self._copies(store, num_layers, "store", dev, device_side=0)
        if stream is None:
            stream = 0
            torch = sys.modules.get("torch")
            if dev >= 0 and torch is not None:
                stream = int(torch.cuda.current_stream(dev).cuda_stream)
        fault_stage, fault_layer = (-1, -1) if _fault is None else (_STAGES[_fault[0]], _fault[1])
        self._p = _C.LayerPipeline(
            num_layers,
            fetch_t,
            store_t,
            depth=depth,
            device=dev,
            stream=stream,
            bytes_per_second=bytes_per_second,
            fault_stage=fault_stage,
            fault_layer=fault_layer,
            gated=gated,
        )
        self._closed = False

    def _copies(
        self, entries: Sequence[Copy] | None, num_layers: int, name: str, dev: int, device_side: int
    ) -> list[list[tuple[int, int, int]]]:
        """Per layer, the (src, dst, nbytes) segments of ``entries``; raises ValueError/TypeError
        on a wrong count, size mismatch, null address or wrong device, naming the segment."""
        if entries is None:
            return []
        if len(entries) != num_layers:
            raise ValueError(f"{name}: {len(entries)} pairs for {num_layers} layers")
        out = []
        for i, entry in enumerate(entries):
            if isinstance(entry, list):  # a list is a segment list; a tuple is one segment
                out.append(
                    [
                        self._segment(seg, f"{name}[{i}][{k}]", dev, device_side)
                        for k, seg in enumerate(entry)
                    ]
                )
            else:
                out.append([self._segment(entry, f"{name}[{i}]", dev, device_side)])
        return out

    def _segment(self, seg: Segment, what: str, dev: int, device_side: int) -> tuple[int, int, int]:
        """(src, dst, nbytes) of one segment; keeps its buffers alive until close."""
        if not isinstance(seg, tuple | list) or len(seg) not in (2, 3):
            raise TypeError(
                f"{what}: expected (source, destination) or (src_addr, dst_addr, nbytes), "
                f"got {type(seg).__name__}"
            )
        if len(seg) == 3:
            try:  # any integer type (numpy's too), but not bool or float
                if any(isinstance(x, bool) for x in seg):
                    raise TypeError
                s_addr, d_addr, n = (operator.index(x) for x in seg)
            except TypeError:
                raise TypeError(
                    f"{what}: a triple must be (src_addr, dst_addr, nbytes) integers"
                ) from None
            if min(s_addr, d_addr, n) < 0:
                raise ValueError(f"{what}: negative address or size in {seg!r}")
            if n and not (s_addr and d_addr):
                raise ValueError(f"{what}: null address")
            return s_addr, d_addr, n
        src, dst = seg
        s_addr, s_n, s_kind = _address(src, f"{what} source", writable=False)
        d_addr, d_n, d_kind = _address(dst, f"{what} destination", writable=True)
        if s_n != d_n:
            raise ValueError(f"{what}: source has {s_n} bytes, destination {d_n}")
        for side, kind in enumerate((s_kind, d_kind)):
            want = "cuda" if dev >= 0 and side == device_side else "cpu"
            if kind not in ("raw", want):
                raise ValueError(
                    f"{what}: {('source', 'destination')[side]} is on {kind}, expected {want}"
                )
        self._keepalive += [src, dst]
        return s_addr, d_addr, s_n

    @property
    def num_layers(self) -> int:
        return self._p.num_layers

    @property
    def depth(self) -> int:
        return self._p.depth

    @property
    def max_in_flight(self) -> int:
        """Most layers that were in flight at once so far (always <= depth)."""
        return self._p.max_in_flight

    @property
    def gated(self) -> bool:
        """True if fetches wait for ``source_ready``."""
        return self._p.gated

    def source_ready(self, layer: int) -> bool:
        """Gated only: the host source bytes of ``layer`` are complete; its fetch may start.

        Thread-safe (typically called from a reader thread while the main thread blocks in
        ``wait_fetched``; the GIL is released). Layers must be announced in order 0, 1, ...
        (ValueError otherwise, or if the pipeline is not gated). After ``close``/``abort`` or a
        failure the call is ignored and returns False, so a reader racing with shutdown needs
        no error handling; otherwise returns True. The source bytes must not change afterwards.
        """
        return self._p.source_ready(layer)

    def source_failed(self, layer: int, message: str) -> bool:
        """Gated only: the host bytes of ``layer`` will never arrive.

        The pipeline fails like a fetch error: ``RuntimeError("source of layer <layer> failed:
        <message>")`` is raised at the next ``wait_fetched``/``computed`` or at ``close``, and
        every blocked call and worker wakes up. Thread-safe. Ignored (returns False) after
        ``close``/``abort`` or an earlier failure, which stays the reported error; else True.
        """
        return self._p.source_failed(layer, message)

    def wait_fetched(self, layer: int) -> None:
        """Block (GIL released) until ``layer`` is fetched; layers go 0, 1, ... in order.

        CPU: the destination holds the layer's bytes on return. CUDA: the compute stream is
        ordered after the copy. Raises RuntimeError for a failed stage, ValueError on misuse.
        """
        self._p.wait_fetched(layer)

    def computed(self, layer: int) -> None:
        """Mark ``layer`` computed (after its ``wait_fetched``); its store may now read the
        store source. Does not block on the store."""
        self._p.computed(layer)

    def layers(self) -> Iterator[int]:
        """Yield 0..L-1, waiting for each layer's fetch before and marking it computed after
        the loop body; a body that raises leaves the layer un-computed (never stored)."""
        for i in range(self.num_layers):
            self.wait_fetched(i)
            yield i
            self.computed(i)

    def timestamps(self) -> np.ndarray:
        """int64 [layer, stage (fetch, compute, store), (start, end)] in steady_clock ns
        (comparable with ``banaserve._C.steady_clock_ns()``); -1 where not reached."""
        return self._p.timestamps()

    def close(self) -> None:
        """Wait for the stores of all computed layers, stop and join the threads. Idempotent.

        Raises a stage error that no earlier call has raised, so errors are never lost."""
        if self._closed:
            return
        self._closed = True
        try:
            self._p.close()
        finally:
            self._keepalive.clear()

    def abort(self) -> None:
        """Stop without waiting for pending stores and join the threads. Never raises."""
        self._closed = True
        self._p.abort()
        self._keepalive.clear()

    def __enter__(self) -> LayerPipeline:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            # The body's exception is the one to see; pending stores are abandoned.
            self.abort()

    def __del__(self) -> None:
        p = getattr(self, "_p", None)
        if p is not None:
            p.abort()
