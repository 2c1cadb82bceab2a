"""``shm://``: control frames over TCP, page bytes through a shared-memory segment.

For a server on the same host. The client creates the segment, announces it in HELLO, and
owns it: it grows it (a new, larger segment announced with SHM_ATTACH) when a request needs
more, and unlinks it on close. One request at a time uses the segment (a transport is driven by
one thread), so the layout is simply: request payload, or reply payload, from offset 0.
A PUT copies the caller's buffers into the segment and the server reads them from there; a GET
reply is written there by the server and copied into the caller's buffers after the reply.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

from banaserve.kvstore.protocol import Op, ProtocolError, payload_bytes
from banaserve.kvstore.transport.base import Address, Sink
from banaserve.kvstore.transport.tcp import TcpTransport, _sink_targets

INITIAL_SEGMENT_BYTES = 16 << 20
_GROWTH_ALIGN = 1 << 20


def create_segment(size: int) -> shared_memory.SharedMemory:
    """A new segment of ``size`` bytes with its memory reserved.

    Reserving up front (posix_fallocate) turns a full /dev/shm into an OSError here, instead
    of a SIGBUS on first touch that would kill the process.
    """
    segment = shared_memory.SharedMemory(create=True, size=size)
    fd = getattr(segment, "_fd", -1)
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            destroy_segment(segment)
            raise OSError(
                exc.errno, f"cannot reserve {size} bytes of shared memory (/dev/shm full?)"
            ) from exc
    return segment


def destroy_segment(segment: shared_memory.SharedMemory) -> None:
    """Unmap and unlink; never raises (a lingering view only delays the unmap to GC)."""
    try:
        segment.close()
    except BufferError:
        pass
    try:
        segment.unlink()
    except FileNotFoundError:
        pass


class ShmTransport(TcpTransport):
    """See the module docstring and :class:`Transport`. Not thread-safe."""

    def __init__(self, address: Address, timeout: float) -> None:
        super().__init__(address, timeout)
        self._segment: shared_memory.SharedMemory | None = None

    @property
    def segment_bytes(self) -> int:
        return self._segment.size if self._segment is not None else 0

    def connect(self, token: str | None) -> dict[str, Any]:
        self._segment = create_segment(INITIAL_SEGMENT_BYTES)
        return super().connect(token)  # closes (and unlinks) on failure

    def _hello(self, token: str | None) -> dict[str, Any]:
        hello = super()._hello(token)
        assert self._segment is not None
        hello["shm"] = {"name": self._segment.name, "size": self._segment.size}
        return hello

    def request(
        self,
        op: Op,
        control: dict[str, Any],
        payload: Sequence[memoryview] = (),
        sink: Sink | None = None,
        reply_capacity: int = 0,
    ) -> dict[str, Any]:
        if op not in (Op.GET, Op.PUT):
            return super().request(op, control, payload, sink, reply_capacity)
        self._ensure_capacity(max(sum(v.nbytes for v in payload), reply_capacity))
        segment = self._segment
        assert segment is not None
        offset = 0
        for view in payload:
            segment.buf[offset : offset + view.nbytes] = view
            offset += view.nbytes
        reply = super().request(op, {**control, "shm": True})
        nbytes = payload_bytes(op, reply, reply=True)
        if nbytes:
            if nbytes > segment.size:
                self.close()
                raise ProtocolError(f"reply of {nbytes} bytes overflows the {segment.size} segment")
            offset = 0
            for target in _sink_targets(sink, reply, nbytes):
                target[:] = segment.buf[offset : offset + target.nbytes]
                offset += target.nbytes
        return reply

    def _ensure_capacity(self, nbytes: int) -> None:
        """Replace the segment by a larger one if ``nbytes`` do not fit (one SHM_ATTACH)."""
        if self._segment is None:
            raise ConnectionError(f"kv store at {self.address.url}: not connected")
        if nbytes <= self._segment.size:
            return
        size = max(nbytes, 2 * self._segment.size)
        size = min(-(-size // _GROWTH_ALIGN) * _GROWTH_ALIGN, max(self.max_payload, nbytes))
        segment = create_segment(size)
        try:
            super().request(Op.SHM_ATTACH, {"name": segment.name, "size": segment.size})
        except BaseException:
            destroy_segment(segment)
            raise
        old, self._segment = self._segment, segment
        destroy_segment(old)

    def close(self) -> None:
        super().close()
        segment, self._segment = self._segment, None
        if segment is not None:
            destroy_segment(segment)
