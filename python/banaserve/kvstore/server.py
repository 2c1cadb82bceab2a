"""The KV store server: one :class:`PageStore` served over the wire protocol.

Run it with ``python -m banaserve.kvstore.server --port P --capacity-gb N`` (see ``--help``).

Concurrency: every connection is an asyncio task on one event loop; a connection handles one
request at a time, in order. Store calls run on a small thread pool, one batch per request,
because the SSD tier may block on disk and the event loop must keep serving other connections.

In-flight prefix coalescing (LOOKUP, RELEASE; see :mod:`banaserve.kvstore.claims`): the
server keeps a :class:`ClaimTable` on its event loop. A LOOKUP that waits for a claimed key
suspends only its own connection's task (other connections keep being served); a PUT ends the
claims on its keys and wakes their waiters; a closed connection ends the claims it made.

A frame is checked in full before it has any effect: header bounds before the control map is
read, the control map's schema before the payload is allocated, the whole payload before the
first page of a PUT is stored. Anything wrong gets an ERROR reply (when the peer still listens)
and the connection is closed; other connections carry on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from banaserve.kvstore import TOKEN_ENV
from banaserve.kvstore.claims import DEFAULT_MAX_CLAIMS, ClaimTable
from banaserve.kvstore.protocol import (
    HEADER_BYTES,
    MISSING,
    PROTOCOL_VERSION,
    ErrorCode,
    Header,
    Limits,
    Op,
    ProtocolError,
    decode_header,
    encode_error,
    encode_head,
    unpack_control,
    validate_request,
)
from banaserve.kvstore.storage.base import PageStore
from banaserve.kvstore.transport import aio
from banaserve.kvstore.transport.base import Address
from banaserve.kvstore.transport.tcp import tune_socket

logger = logging.getLogger("banaserve.kvstore.server")

GiB = 1 << 30


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    #: None: any client may connect. Otherwise HELLO must carry exactly this token.
    token: str | None = None
    limits: Limits = field(default_factory=Limits)
    #: A new connection must complete HELLO within this many seconds.
    hello_timeout: float = 10.0
    store_threads: int = 4
    #: Call the store on the event loop itself. Right for a RAM-only store, whose calls never
    #: wait on disk (it saves a thread hop per request); with an SSD tier calls go to threads.
    store_inline: bool = False
    #: Keys the in-flight claim table holds at most (LOOKUP with ``claim``).
    max_claims: int = DEFAULT_MAX_CLAIMS
    #: Reported by STATS so an operator sees what the store was started with.
    info: dict[str, Any] = field(default_factory=dict)


class _Connection:
    """Per-connection state; touched only by its own task."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.authenticated = False
        self.request_id = 0
        self.segment: shared_memory.SharedMemory | None = None
        #: Seen closed by its peer while a LOOKUP of it waited (see KvStoreServer._watch_eof).
        self.gone = False

    def detach(self) -> None:
        segment, self.segment = self.segment, None
        if segment is not None:
            with contextlib.suppress(BufferError):
                segment.close()  # the client owns the segment and unlinks it


class _StoreFailure(Exception):
    """The store raised; reported as an INTERNAL error."""


class KvStoreServer:
    """Serves ``store`` (which the caller owns and closes) until :meth:`close`.

    ``start`` binds and begins accepting; ``close`` stops accepting, closes every connection and
    waits for their tasks. Both must be awaited on the loop that serves.
    """

    def __init__(self, store: PageStore, config: ServerConfig | None = None) -> None:
        self.store = store
        self.config = config or ServerConfig()
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._connections: set[_Connection] = set()
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
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
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
            tune_socket(sock)
            task = loop.create_task(self._serve(sock, f"{peer[0]}:{peer[1]}"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket, peer: str) -> None:
        conn = _Connection(sock, peer)
        self._connections.add(conn)
        try:
            await self._converse(conn)
        except ProtocolError as exc:
            self._counters["refused"] += 1
            logger.info("closing %s: %s", peer, exc)
            await self._refuse(conn, exc.code, str(exc))
        except _StoreFailure as exc:
            logger.exception("store failed serving %s", peer)
            await self._refuse(conn, ErrorCode.INTERNAL, f"store failure: {exc}")
        except asyncio.TimeoutError:  # before OSError: since 3.11 it is the builtin, an OSError
            logger.info("closing %s: no HELLO within %.0f s", peer, self.config.hello_timeout)
            await self._refuse(conn, ErrorCode.PROTOCOL, "no HELLO in time")
        except OSError as exc:
            logger.debug("connection %s lost: %s", peer, exc)
        finally:
            self._connections.discard(conn)
            self.claims.drop_holder(conn)  # a dead client must not hold up the others
            conn.detach()
            sock.close()

    async def _refuse(self, conn: _Connection, code: ErrorCode, message: str) -> None:
        """Best effort: send an ERROR, then drain briefly so the close does not reset the
        connection before the peer has read the ERROR (unread input makes the kernel send RST).
        """
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError, asyncio.TimeoutError, ProtocolError):
            frame = encode_error(conn.request_id, code, message)
            await asyncio.wait_for(aio.send_views(loop, conn.sock, [frame]), 1.0)
            conn.sock.shutdown(socket.SHUT_WR)
            scratch = bytearray(64 << 10)
            deadline = loop.time() + 1.0
            drained = 0
            while drained < (16 << 20) and (left := deadline - loop.time()) > 0:
                n = await asyncio.wait_for(loop.sock_recv_into(conn.sock, scratch), left)
                if n == 0:
                    break
                drained += n

    async def _converse(self, conn: _Connection) -> None:
        head = bytearray(HEADER_BYTES)
        while True:
            read = self._read_frame(conn, head)
            if not conn.authenticated:  # strangers get a deadline; clients may idle
                read = asyncio.wait_for(read, self.config.hello_timeout)
            frame = await read
            if frame is None:
                return
            self._counters["requests"] += 1
            await self._dispatch(conn, *frame)

    async def _read_frame(
        self, conn: _Connection, head: bytearray
    ) -> tuple[Header, dict[str, Any], bytearray | None] | None:
        """The next validated frame, or None if the peer closed between frames."""
        loop = asyncio.get_running_loop()
        try:
            if not await aio.recv_exact_into(loop, conn.sock, memoryview(head), eof_ok=True):
                return None
            return await self._read_rest(conn, head)
        except aio.PeerClosed as exc:
            # A peer that only half-closed can still read why its frame went unanswered.
            raise ProtocolError(f"truncated frame: {exc}") from None

    async def _read_rest(
        self, conn: _Connection, head: bytearray
    ) -> tuple[Header, dict[str, Any], bytearray | None]:
        loop = asyncio.get_running_loop()
        header = decode_header(head, self.config.limits)
        conn.request_id = header.request_id
        if not conn.authenticated and header.op is not Op.HELLO:
            raise ProtocolError(f"the first frame must be HELLO, got {header.op.name}")
        body = bytearray(header.control_len)
        await aio.recv_exact_into(loop, conn.sock, memoryview(body))
        control = validate_request(header, unpack_control(body), self.config.limits)
        payload = None
        if header.payload_len:
            # Allocated only now: the control map has been checked to declare exactly this.
            payload = bytearray(header.payload_len)
            await aio.recv_exact_into(loop, conn.sock, memoryview(payload))
        self._counters["bytes_in"] += HEADER_BYTES + header.control_len + header.payload_len
        return header, control, payload

    async def _dispatch(
        self, conn: _Connection, header: Header, control: dict[str, Any], payload: bytearray | None
    ) -> None:
        op = header.op
        if op is Op.HELLO:
            reply = self._hello(conn, control)
        elif op is Op.SHM_ATTACH:
            conn.detach()
            conn.segment = _attach(control["name"])
            reply = {"size": conn.segment.size}
        elif op is Op.EXISTS:
            present = await self._in_store(_contains_all, self.store, control["keys"])
            reply = {"present": present}
        elif op is Op.GET:
            await self._get(conn, header, control)
            return
        elif op is Op.PUT:
            reply = {"stored": await self._put(conn, control, payload)}
        elif op is Op.STATS:
            reply = {"store": asdict(self.store.stats()), "server": self._info()}
        elif op is Op.LOOKUP:
            reply = await self._lookup(conn, control)
        elif op is Op.RELEASE:
            owner = control["owner"]
            released = [self.claims.release(key, owner) for key in control["keys"]]
            self._counters["released"] += sum(released)
            reply = {"released": released}
        else:  # pragma: no cover - validate_request lets only the ops above through
            raise ProtocolError(f"unhandled op {op.name}")
        await self._reply(conn, op, header.request_id, reply)

    def _hello(self, conn: _Connection, control: dict[str, Any]) -> dict[str, Any]:
        check_hello(control, conn.authenticated, self.config.token)
        spec = control.get("shm")
        if spec is not None:
            conn.segment = _attach(spec["name"])
        conn.authenticated = True
        return {
            "version": PROTOCOL_VERSION,
            "server": "banaserve-kv-store",
            "max_payload": self.config.limits.max_payload,
            "shm": conn.segment is not None,
        }

    async def _get(self, conn: _Connection, header: Header, control: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        byte_range = control.get("range")
        views = await self._in_store(
            read_pages, self.store, control["keys"], control["lengths"], byte_range
        )
        sizes = [MISSING if v is None else v.nbytes for v in views]
        found = [v for v in views if v is not None]
        if control.get("shm"):
            segment = _segment_of(conn)
            total = sum(v.nbytes for v in found)
            progress = _progress_offset(control.get("progress"), segment)
            room = segment.size if progress is None else progress
            if total > room:
                raise ProtocolError(
                    f"GET reply of {total} bytes over the {room}-byte shm segment",
                    ErrorCode.TOO_LARGE,
                )
            if progress is None:
                _copy_pages(segment.buf, found)
                await self._reply(conn, Op.GET, header.request_id, {"sizes": sizes, "shm": True})
                return
            # Pipelined: answer first, then fill the segment chunk by chunk, publishing the
            # bytes written in the progress word so the client copies out meanwhile.
            word = segment.buf[progress : progress + 8].cast("Q")
            try:
                word[0] = 0
                reply = {"sizes": sizes, "shm": True, "progress": True}
                await self._reply(conn, Op.GET, header.request_id, reply)
                _copy_pages(segment.buf, found, word)
            finally:
                word.release()
            return
        head = encode_head(
            Op.GET, header.request_id, {"sizes": sizes}, sum(v.nbytes for v in found), reply=True
        )
        self._counters["bytes_out"] += await aio.send_views(loop, conn.sock, [head, *found])

    async def _lookup(self, conn: _Connection, control: dict[str, Any]) -> dict[str, Any]:
        """LOOKUP (see :class:`Op`): wait for keys claimed by others, then claim the missing
        tail for ``owner``, tied to ``conn``.

        One store call for the whole batch in the common case, one more per key waited on.
        A claim is looked at *before* the store is asked, so a PUT landing in between is
        seen either as the key present or as the claim ended (never as neither): a waiter
        cannot miss a page that was stored while it looked.
        """
        claims, counters = self.claims, self._counters
        keys: list[bytes] = control["keys"]
        owner: str = control["owner"]
        deadline = claims.clock() + control["wait_ms"] / 1000
        held = [claims.holder(key) for key in keys]
        present: list[bool] = await self._in_store(_contains_all, self.store, keys)
        first_miss, timed_out = len(keys), False
        unwatch: Callable[[], None] | None = None
        try:
            for i, key in enumerate(keys):
                claim = held[i]
                while not present[i] and claim is not None and claim.owner != owner:
                    if claims.clock() >= deadline or conn.gone:
                        timed_out = not conn.gone
                        break
                    if unwatch is None:
                        counters["claim_waits"] += 1
                        unwatch = self._watch_eof(conn)
                    await claims.wait(claim, deadline)
                    claim = claims.holder(key)
                    (present[i],) = await self._in_store(_contains_all, self.store, [key])
                    counters["coalesced"] += present[i]
                if not present[i]:
                    first_miss = i
                    break
        finally:
            if unwatch is not None:
                unwatch()
        counters["wait_timeouts"] += timed_out
        claimed = [False] * len(keys)
        if control["claim"] and not conn.gone:
            lease_s = control["lease_ms"] / 1000
            for j in range(first_miss, len(keys)):
                if not present[j]:
                    # After a wait that ran out, take over: this caller computes the tail now,
                    # and the owner it waited for has not delivered in time.
                    claimed[j] = claims.claim(keys[j], owner, conn, lease_s, force=timed_out)
            counters["claims"] += sum(claimed)
        return {"present": present, "claimed": claimed}

    def _watch_eof(self, conn: _Connection) -> Callable[[], None]:
        """While a LOOKUP of ``conn`` waits, its task reads nothing, so it would notice its
        peer dying only after the wait. Watch the socket meanwhile: on EOF (or an error) end
        the claims ``conn`` made at once, so whoever waits on them stops. Returns the undo.

        Data arriving instead (a client pipelining its next frame) just ends the watch: the
        bytes stay queued for ``_converse`` (MSG_PEEK).
        """
        loop = asyncio.get_running_loop()
        fd = conn.sock.fileno()

        def readable() -> None:
            try:
                data = conn.sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            loop.remove_reader(fd)
            if not data:
                conn.gone = True
                self.claims.drop_holder(conn)

        loop.add_reader(fd, readable)
        return lambda: loop.remove_reader(fd)

    async def _put(
        self, conn: _Connection, control: dict[str, Any], payload: bytearray | None
    ) -> list[bool]:
        sizes: list[int] = control["sizes"]
        total = sum(sizes)
        if control.get("shm"):
            segment = _segment_of(conn)
            if total > segment.size:
                raise ProtocolError(
                    f"PUT of {total} bytes over the {segment.size}-byte shm segment",
                    ErrorCode.TOO_LARGE,
                )
            source = segment.buf
        else:
            source = memoryview(payload if payload is not None else b"")
        # Pages become immutable bytes (the store keeps them); this is the one copy a PUT pays.
        values, offset = [], 0
        for size in sizes:
            values.append(bytes(source[offset : offset + size]))
            offset += size
        del source
        try:
            return await self._in_store(_put_all, self.store, control["keys"], values)
        finally:
            # Stored or refused (too big), or the store failed: either way the computation
            # behind the claim is over, so its waiters look again (and claim it if missing).
            self.claims.stored(control["keys"])

    async def _reply(
        self, conn: _Connection, op: Op, request_id: int, control: dict[str, Any]
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
            "max_payload": self.config.limits.max_payload,
            **self._counters,
            "claims_expired": self.claims.expired,
            "claims_held": len(self.claims),
            **self.config.info,
        }


# -- store calls (run on the executor) --------------------------------------------------------


def _contains_all(store: PageStore, keys: list[bytes]) -> list[bool]:
    return [store.contains(key) for key in keys]


def check_hello(control: dict[str, Any], authenticated: bool, token: str | None) -> None:
    """Refuse a second HELLO, another protocol version, or a wrong token (ProtocolError; the
    token comparison takes constant time). Shared by every server transport."""
    if authenticated:
        raise ProtocolError("HELLO sent twice on one connection")
    if control["version"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"client speaks protocol {control['version']}, server {PROTOCOL_VERSION}"
        )
    if token is not None:
        offered = control.get("token") or ""
        if not hmac.compare_digest(offered.encode(), token.encode()):
            raise ProtocolError("authentication failed: wrong or missing token", ErrorCode.AUTH)


def read_pages(
    store: PageStore, keys: list[bytes], lengths: list[int], byte_range: list[int] | None
) -> list[memoryview | None]:
    """The requested bytes of each page, or None if missing or not exactly ``lengths[i]``."""
    views: list[memoryview | None] = []
    for key, length in zip(keys, lengths, strict=True):
        page = store.get(key)
        if page is None:
            views.append(None)
            continue
        view = memoryview(page)
        if byte_range is not None:
            offset, size = byte_range
            view = view[offset : offset + size]
        views.append(view if view.nbytes == length else None)
    return views


def _put_all(store: PageStore, keys: list[bytes], values: list[bytes]) -> list[bool]:
    return [store.put(key, value) for key, value in zip(keys, values, strict=True)]


# -- shared memory ----------------------------------------------------------------------------


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map a client's segment without adopting it: the client unlinks it, not this process."""
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        raise ProtocolError(
            f"shared-memory segment {name!r} not found: shm:// needs the store server on the "
            "same host as the client (use tcp:// across hosts)",
            ErrorCode.SHM,
        ) from None
    except OSError as exc:
        message = f"cannot map shared-memory segment {name!r}: {exc}"
        raise ProtocolError(message, ErrorCode.SHM) from None
    # Python < 3.13 registers every attached segment with this process's resource tracker,
    # which would unlink the client's segment when the server exits.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


#: Bytes a pipelined shm GET copies between updates of the progress word.
SHM_CHUNK_BYTES = 256 << 10


def _progress_offset(value: Any, segment: shared_memory.SharedMemory) -> int | None:
    """A GET's ``progress`` field: None, or an 8-aligned offset of 8 bytes inside the segment."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"GET: 'progress' must be an int offset, got {value!r}")
    if value < 0 or value % 8 or value + 8 > segment.size:
        raise ProtocolError(
            f"GET: progress offset {value} not an aligned word of the {segment.size}-byte segment"
        )
    return value


def _copy_pages(buf: memoryview, views: list[memoryview], word: memoryview | None = None) -> None:
    """Copy ``views`` back to back from offset 0 of ``buf``; with ``word``, store in it the
    bytes copied so far about every :data:`SHM_CHUNK_BYTES` and at the end."""
    offset = published = 0
    for view in views:
        size = view.nbytes
        if word is None or size <= SHM_CHUNK_BYTES:
            buf[offset : offset + size] = view
            offset += size
        else:
            for start in range(0, size, SHM_CHUNK_BYTES):
                piece = view[start : start + SHM_CHUNK_BYTES]
                buf[offset : offset + piece.nbytes] = piece
                offset += piece.nbytes
                word[0] = published = offset
            continue
        if word is not None and offset - published >= SHM_CHUNK_BYTES:
            word[0] = published = offset
    if word is not None and published != offset:
        word[0] = offset


def _segment_of(conn: _Connection) -> shared_memory.SharedMemory:
    if conn.segment is None:
        raise ProtocolError("request says shm but no shared-memory segment was announced")
    return conn.segment


# -- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m banaserve.kvstore.server",
        description="BanaServe global KV cache store server (one shard).",
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    parser.add_argument("--capacity-gb", type=float, required=True, help="RAM tier capacity")
    parser.add_argument("--ssd-dir", default=None, help="directory of the SSD tier (optional)")
    parser.add_argument("--ssd-capacity-gb", type=float, default=0.0, help="SSD tier capacity")
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"shared secret clients must present (default: ${TOKEN_ENV}, which is better: "
        "argv is visible to other users; neither: no auth)",
    )
    parser.add_argument(
        "--max-payload-mb",
        type=int,
        default=Limits().max_payload >> 20,
        help="largest payload of one frame, in MiB",
    )
    parser.add_argument(
        "--ucx-port",
        type=int,
        default=None,
        help="also serve ucx:// on this port (0: the TCP port + 1); needs banaserve[ucx]",
    )
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    return parser


def _build_store(args: argparse.Namespace) -> PageStore:
    from banaserve.kvstore.storage.tiered import TieredStore

    if args.ssd_dir is not None and args.ssd_capacity_gb <= 0:
        raise SystemExit("--ssd-dir needs --ssd-capacity-gb > 0")
    return TieredStore(
        int(args.capacity_gb * GiB),
        ssd_dir=args.ssd_dir,
        ssd_capacity_bytes=int(args.ssd_capacity_gb * GiB),
    )


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT, then close connections and flush the store."""
    if args.capacity_gb <= 0:
        raise SystemExit("--capacity-gb must be positive")
    store = _build_store(args)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        token=args.token or None,
        limits=Limits(max_payload=args.max_payload_mb << 20),
        store_inline=args.ssd_dir is None,
        info={
            "capacity_bytes": int(args.capacity_gb * GiB),
            "ssd_dir": args.ssd_dir,
            "ssd_capacity_bytes": int(args.ssd_capacity_gb * GiB),
            "auth": args.token is not None,
        },
    )
    server = KvStoreServer(store, config)
    ucx = None
    try:
        try:
            await server.start()
        except OSError as exc:
            raise SystemExit(f"kv store cannot listen on {args.host}:{args.port}: {exc}") from None
        if args.ucx_port is not None:
            from banaserve.kvstore.ucx_server import start_ucx_listener

            ucx_port = args.ucx_port or server.address.port + 1
            # Blocks until listening (the first UCX context takes ~0.5 s): keep it off the loop.
            ucx = await asyncio.to_thread(
                start_ucx_listener,
                store,
                config,
                args.host,
                ucx_port,
                on_stored=server.notify_stored,
            )
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ssd = f"SSD {args.ssd_capacity_gb:g} GiB in {args.ssd_dir}" if args.ssd_dir else "no SSD"
        print(
            f"banaserve kv store listening on {server.url} (shm:// too from this host"
            f"{'; ' + ucx.url if ucx is not None else ''}); "
            f"pid {os.getpid()}, RAM {args.capacity_gb:g} GiB, {ssd}, "
            f"auth {'on' if config.token else 'off'}",
            flush=True,
        )
        await stop.wait()
        logger.info("stopping: closing connections and flushing the store")
    finally:
        if ucx is not None:
            await asyncio.to_thread(ucx.close)  # stops its thread, closes its connections
        await server.close()
        store.close()
    print(f"banaserve kv store on {server.url} stopped", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
