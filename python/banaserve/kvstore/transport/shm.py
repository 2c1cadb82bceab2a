"""``shm://``: control frames over TCP, page bytes through a shared-memory segment.

For a server on the same host. The client asks for a segment in HELLO, and the server creates
it and names it in its reply (see :mod:`banaserve.kvstore.segments`); when a request needs
more, the client asks for a larger one with SHM_ATTACH. The client maps each segment and
removes its name: the memory lives while either side has it mapped and goes back to the
kernel when both are gone, even if one is killed (a named segment would stay in /dev/shm,
holding RAM, until reboot).
One request at a time uses the segment (a transport is driven by one thread), so the layout
is simply: request payload, or reply payload, from offset 0.
A PUT copies the caller's buffers into the segment and the server reads them from there.

A GET is pipelined: the request names a ``progress`` word, 8 bytes at the end of the segment
past the reply payload, which the client zeroes before sending. A server that streams (it
says so with ``progress: true`` in the reply) sends the reply's control map first, then copies
the pages into the segment in chunks and stores the number of payload bytes written so far in
the progress word after each chunk; the client copies each chunk into the caller's buffers as
soon as the word covers it, so the server's copy and the client's run at once on two cores
instead of one after the other. (x86 keeps stores in order, so a progress value the client
reads never runs ahead of the bytes it covers; elsewhere the client does not ask for it.)
A server that does not stream (an older one) writes the whole reply before answering, and the
client copies it out after the reply.
"""

from __future__ import annotations

import platform
import select
import time
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

from banaserve.kvstore.op_specs import payload_bytes
from banaserve.kvstore.protocol import ErrorCode, Op, ProtocolError
from banaserve.kvstore.segments import destroy_segment, open_segment
from banaserve.kvstore.transport.base import Address, Sink
from banaserve.kvstore.transport.tcp import TcpTransport, _sink_targets

INITIAL_SEGMENT_BYTES = 16 << 20
_GROWTH_ALIGN = 1 << 20
#: Bytes reserved at the end of the segment for the progress word of a pipelined GET.
PROGRESS_TAIL = 64
#: Whether this client asks for pipelined GETs (needs stores seen in program order; see above).
PIPELINE_GET = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
#: Spins on the progress word before the client starts sleeping in select() between checks.
_SPINS = 20_000


class ShmTransport(TcpTransport):
    """See the module docstring and :class:`Transport`. Not thread-safe."""

    def __init__(self, address: Address, timeout: float) -> None:
        super().__init__(address, timeout)
        self._segment: shared_memory.SharedMemory | None = None

    @property
    def segment_bytes(self) -> int:
        return self._segment.size if self._segment is not None else 0

    def connect(self, token: str | None) -> dict[str, Any]:
        reply = super().connect(token)  # closes on failure
        offered = reply.get("shm")
        try:
            if not isinstance(offered, dict):
                raise ProtocolError(f"{self.address.url} offers no shared memory", ErrorCode.SHM)
            self._segment = open_segment(offered.get("name"), offered.get("size"))
        except BaseException:
            self.close()
            raise
        return reply

    def _auth_control(self, proof: bytes | None) -> dict[str, Any]:
        return {**super()._auth_control(proof), "shm": {"size": INITIAL_SEGMENT_BYTES}}

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
        pipelined = (
            PIPELINE_GET
            and op is Op.GET
            and reply_capacity > 0
            and reply_capacity + PROGRESS_TAIL <= self.max_payload
        )
        put_bytes = sum(v.nbytes for v in payload)
        self._ensure_capacity(max(put_bytes, reply_capacity + (PROGRESS_TAIL if pipelined else 0)))
        segment = self._segment
        assert segment is not None
        buf = segment.buf
        offset = 0
        for view in payload:
            buf[offset : offset + view.nbytes] = view
            offset += view.nbytes
        request = {**control, "shm": True}
        progress = segment.size - 8
        if pipelined:
            buf[progress : progress + 8] = bytes(8)
            request["progress"] = progress
        reply = super().request(op, request)
        nbytes = payload_bytes(op, reply, reply=True)
        if nbytes:
            try:
                if nbytes > (progress if pipelined else segment.size):
                    raise ProtocolError(
                        f"reply of {nbytes} bytes overflows the {segment.size} segment"
                    )
                targets = _sink_targets(sink, reply, nbytes)
                if pipelined and reply.get("progress") is True:
                    self._copy_as_ready(buf, progress, targets)
                else:
                    offset = 0
                    for target in targets:
                        target[:] = buf[offset : offset + target.nbytes]
                        offset += target.nbytes
            except BaseException:
                self.close()
                raise
        return reply

    def _copy_as_ready(self, buf: memoryview, progress: int, targets: Sequence[memoryview]) -> None:
        """Copy the reply out of the segment into ``targets`` while the server still writes it:
        each time take all the bytes the progress word says are there."""
        word = buf[progress : progress + 8].cast("Q")
        try:
            ready = offset = 0
            for target in targets:
                pos, size = 0, target.nbytes
                while pos < size:
                    if ready <= offset:
                        ready = self._wait_progress(word, offset)
                    n = min(size - pos, ready - offset)
                    target[pos : pos + n] = buf[offset : offset + n]
                    pos += n
                    offset += n
        finally:
            word.release()

    def _wait_progress(self, word: memoryview, done: int) -> int:
        """The progress word once it is past ``done``: spin briefly (the server is copying on
        another core), then check between short sleeps that the server is still there."""
        for _ in range(_SPINS):
            if (value := word[0]) > done:
                return value
        sock = self._require()
        deadline = time.monotonic() + self.timeout
        while (value := word[0]) <= done:
            if time.monotonic() > deadline:
                raise TimeoutError(f"kv store at {self.address.url}: shm reply stalled")
            readable, _, _ = select.select([sock], [], [], 0.0002)
            if readable and word[0] <= done:  # nothing may follow a streamed reply: closed
                raise ConnectionResetError(
                    f"kv store at {self.address.url}: connection ended during an shm reply"
                )
        return value

    def _ensure_capacity(self, nbytes: int) -> None:
        """Replace the segment by a larger one if ``nbytes`` do not fit (one SHM_ATTACH)."""
        if self._segment is None:
            raise ConnectionError(f"kv store at {self.address.url}: not connected")
        if nbytes <= self._segment.size:
            return
        size = max(nbytes, 2 * self._segment.size)
        size = min(-(-size // _GROWTH_ALIGN) * _GROWTH_ALIGN, max(self.max_payload, nbytes))
        offered = super().request(Op.SHM_ATTACH, {"size": size})
        segment = open_segment(offered.get("name"), size)
        old, self._segment = self._segment, segment
        destroy_segment(old)

    def close(self) -> None:
        super().close()
        segment, self._segment = self._segment, None
        if segment is not None:
            destroy_segment(segment)
