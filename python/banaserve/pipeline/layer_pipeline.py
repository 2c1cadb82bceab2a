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
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from banaserve import _C

__all__ = ["LayerPipeline", "live_threads"]

#: A buffer: numpy array, torch tensor, or (address, nbytes).
Buffer = Any
#: One layer's copy in one direction: (source, destination).
Copy = tuple[Buffer, Buffer]

_STAGES = {"fetch": 0, "compute": 1, "store": 2}


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
        )
        self._closed = False

    def _copies(
        self, pairs: Sequence[Copy] | None, num_layers: int, name: str, dev: int, device_side: int
    ) -> list[tuple[int, int, int]]:
        if pairs is None:
            return []
        if len(pairs) != num_layers:
            raise ValueError(f"{name}: {len(pairs)} pairs for {num_layers} layers")
        out = []
        for i, (src, dst) in enumerate(pairs):
            s_addr, s_n, s_kind = _address(src, f"{name}[{i}] source", writable=False)
            d_addr, d_n, d_kind = _address(dst, f"{name}[{i}] destination", writable=True)
            if s_n != d_n:
                raise ValueError(f"{name}[{i}]: source has {s_n} bytes, destination {d_n}")
            for side, kind in enumerate((s_kind, d_kind)):
                want = "cuda" if dev >= 0 and side == device_side else "cpu"
                if kind not in ("raw", want):
                    raise ValueError(
                        f"{name}[{i}]: {('source', 'destination')[side]} is on "
                        f"{kind}, expected {want}"
                    )
            self._keepalive += [src, dst]
            out.append((s_addr, d_addr, s_n))
        return out

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
