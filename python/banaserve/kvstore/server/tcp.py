"""The KV store server over tcp:// and shm://: one :class:`PageStore` served over the wire
protocol, each request answered by its handler in :mod:`.ops`.

Run it with ``python -m banaserve.kvstore.server --port P --capacity-gb N`` (see ``--help``
and :mod:`banaserve.kvstore.server.cli`).

Concurrency: every connection is an asyncio task on one event loop; a connection handles one
request at a time, in order. Store calls run on a small thread pool, one batch per request,
because the SSD tier may block on disk and the event loop must keep serving other connections.

Memory: what peers can make the server hold is bounded before it is allocated (connections,
a stranger's bytes, every request's buffers from one budget; see
:mod:`banaserve.kvstore.admission`). Access: AUTH (a proof of a token) grants the shared
keyspace or one tenant's (see :mod:`banaserve.kvstore.auth`).

In-flight prefix coalescing (LOOKUP, RELEASE; see :mod:`banaserve.kvstore.claims`): the
server keeps a :class:`ClaimTable` on its event loop. A LOOKUP that waits for a claimed key
suspends only its own connection's task (other connections keep being served); a PUT ends the
claims on its keys and wakes their waiters; a closed connection ends the claims it made; a
CLEAR (which drops every page, for the shared token only) ends every claim.

A frame is checked in full before it has any effect (:mod:`.conn`),
and the whole payload arrives before the first page of a PUT is stored. Anything wrong gets an
ERROR reply (when the peer still listens) and the connection is closed; others carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from banaserve.kvstore.admission import EVICTED_MESSAGE, MAX_TURNING_AWAY, Admission
from banaserve.kvstore.claims import ClaimTable
from banaserve.kvstore.protocol import (
    HEADER_BYTES,
    ErrorCode,
    Header,
    Op,
    ProtocolError,
    encode_error,
    encode_head,
)
from banaserve.kvstore.server.conn import Connection, Payload, close_politely, forget_frames
from banaserve.kvstore.server.ops import Reply, ServerConfig, StoreOps
from banaserve.kvstore.server.shm import SHM_CHUNK_BYTES, copy_pages, segment_of
from banaserve.kvstore.server.shm import progress_offset as _progress_offset
from banaserve.kvstore.storage.base import PageStore
from banaserve.kvstore.transport import aio
from banaserve.kvstore.transport.base import Address
from banaserve.kvstore.transport.tcp import tune_socket

# SHM_CHUNK_BYTES: what a pipelined shm GET from this server copies per step.
__all__ = ["SHM_CHUNK_BYTES", "KvStoreServer", "ServerConfig"]

logger = logging.getLogger("banaserve.kvstore.server")

_NO_BYTES = memoryview(b"")

T = TypeVar("T")


class _StoreFailure(Exception):
    """The store raised; reported as an INTERNAL error."""


class KvStoreServer:
    """Serves ``store`` (which the caller owns and closes) over tcp:// and shm:// until
    :meth:`close`.

    ``start`` binds and begins accepting; ``close`` stops accepting, closes every connection and
    waits for their tasks. Both must be awaited on the loop that serves. ``admission``: the
    bounds to apply, shared with other listeners of this process (the ucx:// one); by default
    made from ``config``.

    Owns the listening socket, the connections' tasks, the store threads and the claim table.
    Everything but :meth:`notify_stored` is confined to the serving loop; store calls run on
    the store threads (or inline with ``config.store_inline``) since they may block on disk.
    """

    def __init__(
        self,
        store: PageStore,
        config: ServerConfig | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.store = store
        self.config = config or ServerConfig()
        self.admission = admission or self.config.admission()
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._turning_away: set[asyncio.Task[None]] = set()
        self._evicted_frame = encode_error(0, ErrorCode.BUSY, EVICTED_MESSAGE)
        self._connections: set[Connection] = set()
        self._executor = ThreadPoolExecutor(
            self.config.store_threads, thread_name_prefix="kvstore-store"
        )
        # Touched only on the serving loop (``self._loop``); other threads go through
        # notify_stored.
        self.claims = ClaimTable(self.config.max_claims)
        self.ops = StoreOps(
            store, self.config, self.admission, self._in_store, self._describe, self.claims
        )
        self.auth = self.ops.auth
        self._loop: asyncio.AbstractEventLoop | None = None
        self.address: Address | None = None

    @property
    def url(self) -> str:
        if self.address is None:
            raise RuntimeError("server not started")
        return self.address.url

    async def start(self) -> Address:
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.config.host, self.config.port))
            listener.listen(1024)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.address = Address("tcp", self.config.host, listener.getsockname()[1])
        self._loop = asyncio.get_running_loop()
        self._accept_task = self._loop.create_task(self._accept_loop())
        return self.address

    def notify_stored(self, keys: list[bytes]) -> None:
        """Keys stored by another path to the same store (the ucx:// listener's thread): end
        their claims and wake their waiters. Thread-safe; returns at once."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(self.claims.stored, keys)

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
        if self._listener is not None:
            self._listener.close()
        tasks = [*self._tasks, *self._turning_away]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, peer = await loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE and friends: back off rather than spin
                logger.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            if not self.admission.gate.try_enter():
                if not self._evict_oldest_stranger():
                    self._turn_away(sock, f"{peer[0]}:{peer[1]}")
                    continue
                self.admission.gate.enter_in_place()
            tune_socket(sock)
            task = loop.create_task(self._serve(sock, f"{peer[0]}:{peer[1]}"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _evict_oldest_stranger(self) -> bool:
        """Close the connection that has waited longest without authenticating, to make room
        for a new one: strangers that hold their slots idle cannot lock out a peer with the
        token, whose HELLO and AUTH follow its connect at once. False if none is left to close."""
        strangers = [c for c in self._connections if not c.authenticated and not c.evicted]
        if not strangers:
            return False
        oldest = min(strangers, key=lambda c: c.opened)
        oldest.evicted = True
        logger.info("closing %s: the oldest of %d unauthenticated connections", oldest.peer,
                    len(strangers))  # fmt: skip
        with contextlib.suppress(OSError):  # a fresh socket's buffer takes the tiny frame
            oldest.sock.send(self._evicted_frame)
            oldest.sock.shutdown(socket.SHUT_RDWR)  # its task sees the end and leaves the gate
        return True

    def _turn_away(self, sock: socket.socket, peer: str) -> None:
        """A connection over the cap: BUSY and closed, with nothing allocated for it beyond
        the task that drains it before the close (past MAX_TURNING_AWAY of those, not even
        that: the ERROR is sent at once, and the connection closed)."""
        gate = self.admission.gate
        logger.info("turning %s away: %d strangers open", peer, gate.stranger_limit)
        if len(self._turning_away) >= MAX_TURNING_AWAY:
            with contextlib.suppress(OSError):  # a fresh socket's buffer takes the tiny frame
                sock.send(self.admission.gate.busy_frame)
                sock.shutdown(socket.SHUT_WR)
            sock.close()
            return

        async def refuse() -> None:
            try:
                await close_politely(sock, self.admission.gate.busy_frame, 64 << 10, 0.5)
            finally:
                sock.close()

        task = asyncio.get_running_loop().create_task(refuse())
        self._turning_away.add(task)
        task.add_done_callback(self._turning_away.discard)

    async def _serve(self, sock: socket.socket, peer: str) -> None:
        conn = Connection(sock, peer, self.admission.budget)
        self._connections.add(conn)
        try:
            refusal = await self._conversation(conn)
            if refusal is not None:
                await conn.refuse(*refusal)
        finally:
            self._connections.discard(conn)
            self.claims.drop_holder(conn)  # a dead client must not hold up the others
            conn.detach()
            sock.close()
            # Only now: a failed request's buffers lived on in its traceback until
            # _conversation returned, and the budget must cover them until they are gone.
            conn.ticket.release()
            self.admission.gate.leave(conn.authenticated)

    async def _conversation(self, conn: Connection) -> tuple[ErrorCode, str] | None:
        """Serve ``conn`` until it closes or fails; what to refuse it with, if anything."""
        try:
            await self._converse(conn)
        except (ProtocolError, _StoreFailure, asyncio.TimeoutError, OSError) as exc:
            refusal = self._refusal(conn, exc)
            forget_frames(exc)
            return refusal
        return None

    def _refusal(self, conn: Connection, exc: BaseException) -> tuple[ErrorCode, str] | None:
        """Log why ``conn`` ends; the ERROR to send it, if it may still listen."""
        if isinstance(exc, ProtocolError):
            self.ops.counters["refused"] += 1
            logger.info("closing %s: %s", conn.peer, exc)
            return exc.code, str(exc)
        if isinstance(exc, _StoreFailure):
            logger.error("store failed serving %s", conn.peer, exc_info=exc)
            return ErrorCode.INTERNAL, f"store failure: {exc}"
        if isinstance(exc, asyncio.TimeoutError):  # an OSError since 3.11: test it first
            logger.info("closing %s: no HELLO within %.0f s", conn.peer, self.config.hello_timeout)
            return ErrorCode.PROTOCOL, "no HELLO in time"
        logger.debug("connection %s lost: %s", conn.peer, exc)
        return None

    async def _converse(self, conn: Connection) -> None:
        config, admission = self.config, self.admission
        while True:
            frame = await conn.read_frame(config.limits, admission, config.hello_timeout)
            if frame is None:
                return
            self.ops.counters["requests"] += 1
            header = frame[0]
            self.ops.counters["bytes_in"] += HEADER_BYTES + header.control_len + header.payload_len
            await self._dispatch(conn, *frame)
            # Nothing of a request outlives it (an idle connection must not pin its last
            # payload until its next frame), then its budget goes back.
            del frame
            conn.ticket.release()

    async def _dispatch(
        self,
        conn: Connection,
        header: Header,
        control: dict[str, Any],
        payload: Payload | None,
    ) -> None:
        op = header.op
        if op is Op.GET and not control.get("shm"):
            # The reply pins up to this many stored bytes until it has left (an eviction
            # meanwhile cannot free them): charged before any page is looked up.
            await conn.ticket.take(sum(control["lengths"]), self.admission.wait_s, "GET reply")
        handle = self.ops.handler(op)
        # The payload's view goes straight to the handler, which drops it once split.
        reply = await handle(conn, control, self._request_bytes(conn, op, control, payload))
        if op is Op.GET:
            await self._send_get(conn, header, control, reply)
        else:
            await self._reply(conn, op, header.request_id, reply.control)

    def _request_bytes(
        self, conn: Connection, op: Op, control: dict[str, Any], payload: Payload | None
    ) -> memoryview:
        """A PUT's page bytes: the shared segment's or the frame's payload."""
        if op is not Op.PUT:
            return _NO_BYTES
        if not control.get("shm"):
            return memoryview(payload if payload is not None else b"")
        segment = segment_of(conn.segment)
        total = sum(control["sizes"])
        if total > segment.size:
            raise ProtocolError(
                f"PUT of {total} bytes over the {segment.size}-byte shm segment",
                ErrorCode.TOO_LARGE,
            )
        return segment.buf

    async def _send_get(
        self, conn: Connection, header: Header, control: dict[str, Any], reply: Reply
    ) -> None:
        found, request_id = reply.pages, header.request_id
        if control.get("shm"):
            await self._send_get_shm(conn, request_id, control, reply)
            return
        head = encode_head(
            Op.GET, request_id, reply.control, sum(v.nbytes for v in found), reply=True
        )
        sending = aio.send_views(asyncio.get_running_loop(), conn.sock, [head, *found])
        try:
            self.ops.counters["bytes_out"] += await asyncio.wait_for(
                sending, self.admission.frame_timeout
            )
        except asyncio.TimeoutError:
            raise OSError(f"GET reply not sent within {self.admission.frame_timeout:g} s") from None

    async def _send_get_shm(
        self, conn: Connection, request_id: int, control: dict[str, Any], reply: Reply
    ) -> None:
        found = reply.pages
        segment = segment_of(conn.segment)
        total = sum(v.nbytes for v in found)
        progress = _progress_offset(control.get("progress"), segment)
        room = segment.size if progress is None else progress
        if total > room:
            raise ProtocolError(
                f"GET reply of {total} bytes over the {room}-byte shm segment",
                ErrorCode.TOO_LARGE,
            )
        answer = {**reply.control, "shm": True}
        if progress is None:
            copy_pages(segment.buf, found)
            await self._reply(conn, Op.GET, request_id, answer)
            return
        # Pipelined: answer first, then fill the segment chunk by chunk, publishing the
        # bytes written in the progress word so the client copies out meanwhile.
        word = segment.buf[progress : progress + 8].cast("Q")
        try:
            word[0] = 0
            await self._reply(conn, Op.GET, request_id, {**answer, "progress": True})
            copy_pages(segment.buf, found, word)
        finally:
            word.release()

    async def _reply(
        self, conn: Connection, op: Op, request_id: int, control: dict[str, Any]
    ) -> None:
        frame = encode_head(op, request_id, control, reply=True)
        loop = asyncio.get_running_loop()
        self.ops.counters["bytes_out"] += await aio.send_views(loop, conn.sock, [frame])

    async def _in_store(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            if self.config.store_inline:
                return fn(*args)
            return await loop.run_in_executor(self._executor, fn, *args)
        except Exception as exc:
            raise _StoreFailure(f"{type(exc).__name__}: {exc}") from exc

    def _describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "connections": len(self._connections),
            "unauthenticated": sum(not c.authenticated for c in self._connections),
        }
