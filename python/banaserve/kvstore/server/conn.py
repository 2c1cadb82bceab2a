"""One connection of the TCP/shm store server: its state, reading its frames within the
admission bounds (:mod:`banaserve.kvstore.admission`), and closing it politely.

A frame is checked in full before it has any effect: the header's bounds before anything else
is read, the admission bounds (a stranger's tiny HELLO and AUTH; an authenticated request's
bytes from the budget) before any buffer is allocated, the control map's schema before the
payload buffer is allocated. The keys of a validated request are mapped into the connection's
tenant keyspace (:mod:`banaserve.kvstore.auth`) before anything else sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import socket
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

from banaserve.kvstore.admission import Admission, ByteBudget, Ticket, request_buffer
from banaserve.kvstore.auth import OPEN, Grant, Handshake, map_control_keys
from banaserve.kvstore.op_specs import validate_request
from banaserve.kvstore.protocol import (
    HANDSHAKE_OPS,
    HEADER_BYTES,
    ErrorCode,
    Header,
    Limits,
    ProtocolError,
    decode_header,
    encode_error,
    unpack_control,
)
from banaserve.kvstore.segments import create_segment, destroy_segment
from banaserve.kvstore.transport import aio

#: A request's payload buffer: see :func:`banaserve.kvstore.admission.request_buffer`.
Payload = bytearray | mmap.mmap
Frame = tuple[Header, dict[str, Any], Payload | None]

#: What a refused connection's peer may still send us (read and dropped) before the close, so
#: that the close does not reset the connection before the peer has read the ERROR.
DRAIN_BYTES = 16 << 20
DRAIN_S = 1.0
# One scratch buffer for every drain: what lands in it is dropped, and the loop runs one
# receive at a time, so a refusal never allocates.
_SCRATCH = bytearray(64 << 10)


class FrameTimeout(ProtocolError):
    """A frame's body did not arrive within the frame timeout."""


class Connection:
    """Per-connection state of the TCP/shm server: the socket, what AUTH granted, the
    shared-memory segment it created for the client and the budget the current request
    holds. Touched only by its own task (and by :meth:`watch_eof`'s callback, which runs on
    the same loop); reading a frame waits on the peer, within the admission bounds."""

    def __init__(self, sock: socket.socket, peer: str, budget: ByteBudget) -> None:
        self.sock = sock
        self.peer = peer
        self.authenticated = False
        #: When it connected, and whether it was closed to make room for a newer stranger.
        self.opened = time.monotonic()
        self.evicted = False
        #: What the AUTH's token granted; every key this connection sends is mapped by it.
        self.grant: Grant = OPEN
        self.handshake = Handshake()
        #: What the current request holds of the budget; released when it ends.
        self.ticket = Ticket(budget)
        self.request_id = 0
        self.segment: shared_memory.SharedMemory | None = None
        #: Seen closed by its peer while a LOOKUP of it waited (see :meth:`watch_eof`).
        self.gone = False
        self._head = bytearray(HEADER_BYTES)

    @property
    def shm_size(self) -> int | None:
        return None if self.segment is None else self.segment.size

    def create_shm(self, size: int) -> tuple[str, int]:
        self.detach()
        try:
            self.segment = create_segment(size)
        except OSError as exc:
            raise ProtocolError(f"no shared-memory segment: {exc}", ErrorCode.SHM) from None
        return self.segment.name, self.segment.size

    def detach(self) -> None:
        segment, self.segment = self.segment, None
        if segment is not None:
            destroy_segment(segment)  # the name too, if the client never mapped it

    async def read_frame(
        self, limits: Limits, admission: Admission, hello_timeout: float
    ) -> Frame | None:
        """The next validated frame, or None if the peer closed between frames.

        Each frame of a stranger (HELLO, AUTH) must arrive whole within ``hello_timeout``
        (asyncio.TimeoutError); an authenticated peer may idle between frames, but once a
        header arrived the rest must follow within ``admission.frame_timeout``
        (:class:`FrameTimeout`). The frame's buffers are charged to :attr:`ticket`, which the
        caller releases when the request ends.
        """
        loop = asyncio.get_running_loop()
        head = memoryview(self._head)
        try:
            if not self.authenticated:
                return await asyncio.wait_for(
                    self._read(loop, head, limits, admission), hello_timeout
                )
            if not await aio.recv_exact_into(loop, self.sock, head, eof_ok=True):
                return None
            try:
                return await asyncio.wait_for(
                    self._read_rest(loop, limits, admission), admission.frame_timeout
                )
            except asyncio.TimeoutError:
                raise FrameTimeout(
                    f"frame not received within {admission.frame_timeout:g} s of its header"
                ) from None
        except aio.PeerClosed as exc:
            # A peer that only half-closed can still read why its frame went unanswered.
            raise ProtocolError(f"truncated frame: {exc}") from None

    async def _read(
        self,
        loop: asyncio.AbstractEventLoop,
        head: memoryview,
        limits: Limits,
        admission: Admission,
    ) -> Frame | None:
        if not await aio.recv_exact_into(loop, self.sock, head, eof_ok=True):
            return None
        return await self._read_rest(loop, limits, admission)

    async def _read_rest(
        self, loop: asyncio.AbstractEventLoop, limits: Limits, admission: Admission
    ) -> Frame:
        header = decode_header(self._head, limits)
        self.request_id = header.request_id
        if not self.authenticated and header.op not in HANDSHAKE_OPS:
            raise ProtocolError(f"the first frames must be HELLO and AUTH, got {header.op.name}")
        # Before any buffer of this frame exists: the bytes it may make us hold.
        need = admission.admit_header(header, self.authenticated)
        await self.ticket.take(need, admission.wait_s, header.op.name)
        body = request_buffer(header.control_len)
        await aio.recv_exact_into(loop, self.sock, memoryview(body))
        control = validate_request(header, unpack_control(body), limits)
        del body
        map_control_keys(control, self.grant)
        payload = None
        if header.payload_len:
            # Allocated only now: the control map has been checked to declare exactly this.
            payload = request_buffer(header.payload_len)
            await aio.recv_exact_into(loop, self.sock, memoryview(payload))
        return header, control, payload

    async def refuse(self, code: ErrorCode, message: str) -> None:
        """Best effort: tell the peer why (an ERROR frame), then close politely."""
        with contextlib.suppress(ProtocolError):
            await close_politely(self.sock, encode_error(self.request_id, code, message))

    def watch_eof(self, on_gone: Callable[[], None]) -> Callable[[], None]:
        """While a LOOKUP of this connection waits, its task reads nothing, so it would notice
        its peer dying only after the wait. Watch the socket meanwhile: on EOF (or an error)
        set :attr:`gone` and call ``on_gone`` at once. Returns the undo.

        Data arriving instead (a client pipelining its next frame) just ends the watch: the
        bytes stay queued for the next :meth:`read_frame` (MSG_PEEK).
        """
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()

        def readable() -> None:
            try:
                data = self.sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            loop.remove_reader(fd)
            if not data:
                self.gone = True
                on_gone()

        loop.add_reader(fd, readable)
        return lambda: loop.remove_reader(fd)


async def close_politely(
    sock: socket.socket, frame: bytes, drain_bytes: int = DRAIN_BYTES, drain_s: float = DRAIN_S
) -> None:
    """Send ``frame`` (an ERROR), half-close, then read and drop what the peer still sends (at
    most ``drain_bytes`` for ``drain_s``) so that unread input does not make the kernel reset
    the connection before the peer has read the ERROR. Never raises for socket trouble; the
    caller closes ``sock``. Allocates nothing per call."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(aio.send_views(loop, sock, [frame]), 1.0)
        sock.shutdown(socket.SHUT_WR)
        deadline = loop.time() + drain_s
        drained = 0
        while drained < drain_bytes and (left := deadline - loop.time()) > 0:
            n = await asyncio.wait_for(loop.sock_recv_into(sock, _SCRATCH), left)
            if n == 0:
                break
            drained += n


def forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and of the exceptions it chains to.

    A request that failed mid-frame left its buffers in the locals of frames that these
    tracebacks keep, and asyncio's tasks (``wait_for`` runs one) put those exceptions in
    reference cycles: the buffers would live until the cyclic GC runs, past the release of
    their budget. Call once the exception has been logged.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__context__, current.__cause__]
