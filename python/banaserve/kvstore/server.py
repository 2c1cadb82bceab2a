"""The KV store server: one :class:`PageStore` served over the wire protocol.

Run it with ``python -m banaserve.kvstore.server --port P --capacity-gb N`` (see ``--help``
and :mod:`banaserve.kvstore.server_cli`).

Concurrency: every connection is an asyncio task on one event loop; a connection handles one
request at a time, in order. Store calls run on a small thread pool, one batch per request,
because the SSD tier may block on disk and the event loop must keep serving other connections.

Memory: what peers can make the server hold is bounded before it is allocated (connections,
a stranger's bytes, every request's buffers from one budget; see
:mod:`banaserve.kvstore.admission`). Access: HELLO's token grants the shared keyspace or one
tenant's (see :mod:`banaserve.kvstore.auth`).

In-flight prefix coalescing (LOOKUP, RELEASE; see :mod:`banaserve.kvstore.claims`): the
server keeps a :class:`ClaimTable` on its event loop. A LOOKUP that waits for a claimed key
suspends only its own connection's task (other connections keep being served); a PUT ends the
claims on its keys and wakes their waiters; a closed connection ends the claims it made; a
CLEAR (which drops every page, for the shared token only) ends every claim.

A frame is checked in full before it has any effect (:mod:`banaserve.kvstore.server_conn`),
and the whole payload arrives before the first page of a PUT is stored. Anything wrong gets an
ERROR reply (when the peer still listens) and the connection is closed; others carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from banaserve.kvstore.admission import (
    DEFAULT_ADMISSION_WAIT_S,
    DEFAULT_FRAME_TIMEOUT_S,
    DEFAULT_INFLIGHT_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    MAX_TURNING_AWAY,
    Admission,
    ByteBudget,
    ConnectionGate,
)
from banaserve.kvstore.auth import Authenticator, check_clear, check_hello
from banaserve.kvstore.claims import DEFAULT_MAX_CLAIMS, ClaimTable
from banaserve.kvstore.lookup import serve_lookup
from banaserve.kvstore.protocol import (
    HEADER_BYTES,
    MISSING,
    PROTOCOL_VERSION,
    ErrorCode,
    Header,
    Limits,
    Op,
    ProtocolError,
    encode_head,
)
from banaserve.kvstore.server_conn import Connection, Payload, close_politely, forget_frames
from banaserve.kvstore.server_shm import SHM_CHUNK_BYTES, attach, copy_pages, segment_of
from banaserve.kvstore.server_shm import progress_offset as _progress_offset
from banaserve.kvstore.storage.base import PageStore
from banaserve.kvstore.store_calls import contains_all, put_pages, read_pages, split_pages
from banaserve.kvstore.transport import aio
from banaserve.kvstore.transport.base import Address
from banaserve.kvstore.transport.tcp import tune_socket

__all__ = ["SHM_CHUNK_BYTES", "KvStoreServer", "ServerConfig", "read_pages"]

logger = logging.getLogger("banaserve.kvstore.server")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    #: The shared token (the client-chosen keyspace). With neither it nor ``tenant_tokens``,
    #: any client may connect.
    token: str | None = None
    #: tenant -> token: each token grants that tenant's keyspace only (see ``auth``).
    tenant_tokens: dict[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    #: A new connection must complete HELLO within this many seconds.
    hello_timeout: float = 10.0
    store_threads: int = 4
    #: Call the store on the event loop itself. Right for a RAM-only store, whose calls never
    #: wait on disk (it saves a thread hop per request); with an SSD tier calls go to threads.
    store_inline: bool = False
    #: Keys the in-flight claim table holds at most (LOOKUP with ``claim``).
    max_claims: int = DEFAULT_MAX_CLAIMS
    #: Connections served at once (over it: BUSY and closed).
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: Bytes of request buffers (and GET replies being sent) across all connections.
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES
    #: How long a request waits for that budget before it is refused BUSY.
    admission_wait_s: float = DEFAULT_ADMISSION_WAIT_S
    #: Once its header arrived, a frame's body (or a GET reply's payload) must move within this.
    frame_timeout: float = DEFAULT_FRAME_TIMEOUT_S
    #: Reported by STATS so an operator sees what the store was started with.
    info: dict[str, Any] = field(default_factory=dict)

    def admission(self) -> Admission:
        """A fresh :class:`Admission` with these bounds."""
        return Admission(
            ConnectionGate(self.max_connections),
            ByteBudget(self.inflight_bytes),
            self.admission_wait_s,
            self.frame_timeout,
        )


class _StoreFailure(Exception):
    """The store raised; reported as an INTERNAL error."""


class KvStoreServer:
    """Serves ``store`` (which the caller owns and closes) until :meth:`close`.

    ``start`` binds and begins accepting; ``close`` stops accepting, closes every connection and
    waits for their tasks. Both must be awaited on the loop that serves. ``admission``: the
    bounds to apply, shared with other listeners of this process (the ucx:// one); by default
    made from ``config``.
    """

    def __init__(
        self,
        store: PageStore,
        config: ServerConfig | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.store = store
        self.config = config or ServerConfig()
        self.auth = Authenticator.from_config(self.config)
        self.admission = admission or self.config.admission()
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._turning_away: set[asyncio.Task[None]] = set()
        self._connections: set[Connection] = set()
        self._executor = ThreadPoolExecutor(
            self.config.store_threads, thread_name_prefix="kvstore-store"
        )
        self._started = time.monotonic()
        self._counters = {
            "requests": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "refused": 0,
            "claims": 0,  # keys claimed (renewals included)
            "claim_waits": 0,  # LOOKUPs that waited for a key claimed by another owner
            "coalesced": 0,  # keys that became present during such a wait: computations saved
            "wait_timeouts": 0,  # LOOKUPs whose wait ran out with the key still claimed
            "released": 0,  # claims ended by their owner (RELEASE: a computation given up)
            "cleared": 0,  # pages dropped by CLEAR
            "claims_cleared": 0,  # claims ended by CLEAR
        }
        # Touched only on the serving loop (``self._loop``); other threads go through
        # notify_stored.
        self.claims = ClaimTable(self.config.max_claims)
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
                self._turn_away(sock, f"{peer[0]}:{peer[1]}")
                continue
            tune_socket(sock)
            task = loop.create_task(self._serve(sock, f"{peer[0]}:{peer[1]}"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _turn_away(self, sock: socket.socket, peer: str) -> None:
        """A connection over the cap: BUSY and closed, with nothing allocated for it beyond
        the task that drains it before the close (past MAX_TURNING_AWAY of those, not even
        that: the ERROR is sent at once, and the connection closed)."""
        logger.info("turning %s away: %d connections open", peer, self.admission.gate.limit)
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
            self.admission.gate.leave()

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
            self._counters["refused"] += 1
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
            self._counters["requests"] += 1
            header = frame[0]
            self._counters["bytes_in"] += HEADER_BYTES + header.control_len + header.payload_len
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
        if op is Op.HELLO:
            reply = self._hello(conn, control)
        elif op is Op.SHM_ATTACH:
            conn.detach()
            conn.segment = attach(control["name"])
            reply = {"size": conn.segment.size}
        elif op is Op.EXISTS:
            reply = {"present": await self._contains(control["keys"])}
        elif op is Op.GET:
            await self._get(conn, header, control)
            return
        elif op is Op.PUT:
            reply = {"stored": await self._put(conn, control, payload)}
        elif op is Op.STATS:
            reply = {"store": asdict(self.store.stats()), "server": self._info()}
        elif op is Op.LOOKUP:
            reply = await serve_lookup(self.claims, self._counters, self._contains, conn, control)
        elif op is Op.RELEASE:
            owner = control["owner"]
            released = [self.claims.release(key, owner) for key in control["keys"]]
            self._counters["released"] += sum(released)
            reply = {"released": released}
        elif op is Op.CLEAR:
            check_clear(conn.grant)
            reply = {"dropped": await self._in_store(self.store.clear)}
            self._counters["cleared"] += reply["dropped"]
            self._counters["claims_cleared"] += self.claims.clear()
        else:  # pragma: no cover - validate_request lets only the ops above through
            raise ProtocolError(f"unhandled op {op.name}")
        await self._reply(conn, op, header.request_id, reply)

    def _hello(self, conn: Connection, control: dict[str, Any]) -> dict[str, Any]:
        conn.grant = check_hello(control, conn.authenticated, self.auth)
        spec = control.get("shm")
        if spec is not None:
            conn.segment = attach(spec["name"])
        conn.authenticated = True
        return {
            "version": PROTOCOL_VERSION,
            "server": "banaserve-kv-store",
            # Over shm:// the pages cross the client's segment, not server buffers.
            "max_payload": (
                self.config.limits.max_payload
                if conn.segment is not None
                else self.admission.max_payload(self.config.limits)
            ),
            "shm": conn.segment is not None,
            "tenant": conn.grant.tenant,
        }

    async def _get(self, conn: Connection, header: Header, control: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        byte_range = control.get("range")
        in_shm = bool(control.get("shm"))
        if not in_shm:
            # The reply pins up to this many stored bytes until it has left (an eviction
            # meanwhile cannot free them): charged before any page is looked up.
            await conn.ticket.take(sum(control["lengths"]), self.admission.wait_s, "GET reply")
        views = await self._in_store(
            read_pages, self.store, control["keys"], control["lengths"], byte_range
        )
        sizes = [MISSING if v is None else v.nbytes for v in views]
        found = [v for v in views if v is not None]
        if in_shm:
            segment = segment_of(conn.segment)
            total = sum(v.nbytes for v in found)
            progress = _progress_offset(control.get("progress"), segment)
            room = segment.size if progress is None else progress
            if total > room:
                raise ProtocolError(
                    f"GET reply of {total} bytes over the {room}-byte shm segment",
                    ErrorCode.TOO_LARGE,
                )
            if progress is None:
                copy_pages(segment.buf, found)
                await self._reply(conn, Op.GET, header.request_id, {"sizes": sizes, "shm": True})
                return
            # Pipelined: answer first, then fill the segment chunk by chunk, publishing the
            # bytes written in the progress word so the client copies out meanwhile.
            word = segment.buf[progress : progress + 8].cast("Q")
            try:
                word[0] = 0
                reply = {"sizes": sizes, "shm": True, "progress": True}
                await self._reply(conn, Op.GET, header.request_id, reply)
                copy_pages(segment.buf, found, word)
            finally:
                word.release()
            return
        head = encode_head(
            Op.GET, header.request_id, {"sizes": sizes}, sum(v.nbytes for v in found), reply=True
        )
        sending = aio.send_views(loop, conn.sock, [head, *found])
        try:
            self._counters["bytes_out"] += await asyncio.wait_for(
                sending, self.admission.frame_timeout
            )
        except asyncio.TimeoutError:
            raise OSError(f"GET reply not sent within {self.admission.frame_timeout:g} s") from None

    async def _contains(self, keys: list[bytes]) -> list[bool]:
        return await self._in_store(contains_all, self.store, keys)  # type: ignore[no-any-return]

    async def _put(
        self, conn: Connection, control: dict[str, Any], payload: Payload | None
    ) -> list[bool]:
        sizes: list[int] = control["sizes"]
        total = sum(sizes)
        if control.get("shm"):
            segment = segment_of(conn.segment)
            if total > segment.size:
                raise ProtocolError(
                    f"PUT of {total} bytes over the {segment.size}-byte shm segment",
                    ErrorCode.TOO_LARGE,
                )
            source = segment.buf
        else:
            source = memoryview(payload if payload is not None else b"")
        values = split_pages(source, sizes)
        del source  # the payload's mapping goes with its last view, when the request ends
        try:
            return await self._in_store(put_pages, self.store, control["keys"], values)
        finally:
            # Stored or refused (too big), or the store failed: either way the computation
            # behind the claim is over, so its waiters look again (and claim it if missing).
            self.claims.stored(control["keys"])

    async def _reply(
        self, conn: Connection, op: Op, request_id: int, control: dict[str, Any]
    ) -> None:
        frame = encode_head(op, request_id, control, reply=True)
        loop = asyncio.get_running_loop()
        self._counters["bytes_out"] += await aio.send_views(loop, conn.sock, [frame])

    async def _in_store(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            if self.config.store_inline:
                return fn(*args)
            return await loop.run_in_executor(self._executor, fn, *args)
        except Exception as exc:
            raise _StoreFailure(f"{type(exc).__name__}: {exc}") from exc

    def _info(self) -> dict[str, Any]:
        return {
            "version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "url": self.url,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "connections": len(self._connections),
            "unauthenticated": sum(not c.authenticated for c in self._connections),
            "max_payload": self.admission.max_payload(self.config.limits),
            **self._counters,
            **self.admission.stats(),
            "claims_expired": self.claims.expired,
            "claims_held": len(self.claims),
            **self.config.info,
        }


if __name__ == "__main__":
    from banaserve.kvstore.server_cli import main

    main()
