"""The KV store served over ``ucx://``: the same protocol and the same store as the TCP server.

Start it beside a :class:`~banaserve.kvstore.server.KvStoreServer` with
:func:`start_ucx_listener` (by convention on the TCP port + 1) and stop it with
:meth:`UcxListenerHandle.close`. Standalone (tests, benchmarks):
``python -m banaserve.kvstore.ucx_server --port P --capacity-gb N`` (see
:func:`banaserve.kvstore.server.cli.ucx_main`). Each request is answered by its handler in
:mod:`.ops`, the TCP server's; this module reads frames and sends replies.

Threads: one daemon thread owns the UCX worker, the listener and every connection, and also
calls the store (thread-safe already: the TCP server calls it from a thread pool). It never
touches an asyncio loop, so the TCP server's loop is not blocked; a slow store call (SSD tier)
delays only the other ucx:// connections. The thread sleeps in epoll on the worker's event fd
when idle and wakes at least every 100 ms to notice :meth:`UcxListenerHandle.close`.

Validation, admission and access are the TCP server's (see :mod:`.conn`, :mod:`.ops`,
:mod:`banaserve.kvstore.admission`, :mod:`banaserve.kvstore.auth`): headers checked against
:class:`Limits`, HELLO and AUTH first (the token's proof checked by the same kind of
:class:`~banaserve.kvstore.auth.Authenticator`), a stranger's frames held to the
pre-authentication bounds, an authenticated request's buffers (and a GET reply's pages until
sent) charged to the process's one in-flight budget before they exist (a request that does not
fit waits with no receive posted, then is refused BUSY), each control map validated before a
payload buffer exists and its keys mapped into the connection's tenant keyspace, a PUT's whole
payload received before its first page is stored. Anything wrong gets an ERROR reply and the
connection is closed. Connections have a cap of their own (the same number as the TCP
server's): a client that crashed is never noticed here (below), and such leftovers must not
lock tcp:// clients out. Wire mapping and tags: :mod:`banaserve.kvstore.transport.ucx`.

In-flight prefix coalescing is not offered here: LOOKUP is answered like EXISTS (no waiting,
``claimed`` all False, so a ucx:// client computes what is missing, as before), RELEASE
releases nothing and CLEAR drops the pages only. Waiting would need a timer-driven state
machine in this thread; claims are the TCP server's. A PUT over ucx:// does end the TCP
server's claims on its keys (``on_stored``), so tcp:// waiters do not wait for ucx:// pages.

Limits of UCX without endpoint error handling: the server does not learn that a client
crashed (a client that closes says BYE); such a connection keeps an endpoint, a 28-byte receive
and its place under the cap until the server stops. UCX listens on every interface whatever
``host`` says (ucxx's listener takes a port, no address), so the command line allows ucx://
only with a wildcard ``--host`` (:mod:`.cli`). Nor can the listener bound what UCX
buffers itself: eager messages that match no posted receive wait in the worker's unexpected
queue, whoever sent them; a token does not stop a peer that reaches the port from sending them.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from banaserve.kvstore.admission import EVICTED_MESSAGE, Admission, Ticket, request_buffer
from banaserve.kvstore.auth import map_control_keys
from banaserve.kvstore.op_specs import payload_segments, validate_request
from banaserve.kvstore.protocol import (
    HANDSHAKE_OPS,
    HEADER_BYTES,
    ErrorCode,
    Header,
    Op,
    ProtocolError,
    decode_header,
    encode_head,
    unpack_control,
)
from banaserve.kvstore.server.ops import ServerConfig, StoreOps
from banaserve.kvstore.server.ucx_conn import UcxConn, settle
from banaserve.kvstore.storage.base import PageStore
from banaserve.kvstore.transport.base import Address
from banaserve.kvstore.transport.ucx import (
    CONN_ID_BITS,
    EPOLL_SLICE_MS,
    SPIN_POLLS,
    Kind,
    as_array,
    check_request,
    import_libucxx,
    new_worker,
    tag,
)

logger = logging.getLogger("banaserve.kvstore.ucx_server")

#: Seconds an ERROR reply gets to leave before its connection is closed anyway.
REFUSE_GRACE_S = 1.0

T = TypeVar("T")


async def _call(fn: Callable[..., T], *args: Any) -> T:
    """Store calls run on the listener's thread itself (module docstring)."""
    return fn(*args)


def run_now(step: Coroutine[Any, Any, T]) -> T:
    """Run a handler to its end on this thread, which has no event loop. Over ucx:// a handler
    never suspends: store calls run inline (:func:`_call`) and there are no claims to wait for.
    """
    try:
        step.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    step.close()
    raise RuntimeError("a store handler suspended on the ucx:// thread, which has no event loop")


class UcxListenerHandle:
    """A running ucx:// listener; :meth:`close` stops it. Made by :func:`start_ucx_listener`.

    Owns the listener's thread, its UCX worker and every connection; all of them, and the
    handlers (:class:`.ops.StoreOps`, without claims), are confined to that thread, which also
    makes the store calls (they may block it on disk). :meth:`close` is callable from any
    thread; the properties are readable once started.
    """

    def __init__(
        self,
        store: PageStore,
        config: ServerConfig,
        host: str,
        port: int,
        on_stored: Callable[[list[bytes]], None] | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.admission = admission or config.admission()
        self.ops = StoreOps(
            store, config, self.admission, _call, self._describe, on_stored=on_stored
        )
        self.auth = self.ops.auth
        self.host = host
        self._requested_port = port
        self.address: Address | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._conns: dict[int, UcxConn] = {}
        # Closed connections whose requests UCX has not finished cancelling: their buffers
        # must outlive the requests (a UCXRequest does not hold its buffer).
        self._dead: list[UcxConn] = []
        self._thread = threading.Thread(target=self._run, name="kvstore-ucx", daemon=True)

    @property
    def url(self) -> str:
        if self.address is None:
            raise RuntimeError("ucx listener not started")
        return self.address.url

    @property
    def port(self) -> int:
        if self.address is None:
            raise RuntimeError("ucx listener not started")
        return self.address.port

    def close(self, timeout: float = 5.0) -> None:
        """Stop listening, close every connection, join the thread (at most ``timeout`` s).

        Idempotent; callable from any thread, including an asyncio loop's (it blocks for at
        most one epoll slice, 100 ms, plus the closing itself).
        """
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the server thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            libucxx = import_libucxx()
            worker = new_worker()
            incoming: list[int] = []
            # The callback runs inside progress; endpoints are made after it returns.
            listener = libucxx.UCXListener.create(
                worker, self._requested_port, lambda conn_request: incoming.append(conn_request)
            )
            self.address = Address("ucx", self.host, listener.port)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._libucxx, self._worker = libucxx, worker
        knock_buf = bytearray(8)
        knock = worker.tag_recv(as_array(knock_buf), libucxx.UCXXTag(tag(0, Kind.KNOCK)))
        idle = 0
        try:
            while not self._stop.is_set():
                if idle < SPIN_POLLS:
                    worker.progress()
                else:
                    worker.progress_worker_event(epoll_timeout=EPOLL_SLICE_MS)
                busy = False
                if knock.completed:  # knocks only prove the client reached us; drain them
                    knock = worker.tag_recv(
                        as_array(knock_buf), libucxx.UCXXTag(tag(0, Kind.KNOCK))
                    )
                    busy = True
                while incoming:
                    self._accept(listener, incoming.pop())
                    busy = True
                now = time.monotonic()
                for conn in list(self._conns.values()):
                    busy |= self._step(conn, now)
                if self._dead:
                    self._dead = [c for c in self._dead if not settle(c)]
                idle = 0 if busy else idle + 1
        except Exception:
            logger.exception("ucx listener failed")
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn)
            with contextlib.suppress(Exception):
                worker.cancel_inflight_requests(period=10_000_000, max_attempts=10)
            for conn in self._dead:
                conn.release_budget()
            self._dead.clear()
            del listener, knock

    def _accept(self, listener: Any, conn_request: int) -> None:
        libucxx = self._libucxx
        try:
            ep = listener.create_endpoint_from_conn_request(
                conn_request, endpoint_error_handling=False
            )
        except Exception as exc:
            logger.warning("ucx connection request failed: %s", exc)
            return
        conn_id = 0
        while conn_id == 0 or conn_id in self._conns:
            conn_id = secrets.randbits(CONN_ID_BITS)
        admitted = self.admission.gate.try_enter()
        if not admitted and self._evict_oldest_stranger():
            self.admission.gate.enter_in_place()
            admitted = True
        conn = UcxConn(conn_id, ep, time.monotonic() + self.config.hello_timeout, admitted)
        self._conns[conn_id] = conn
        id_buf = conn_id.to_bytes(8, "little")
        handshake = ep.tag_send(as_array(id_buf), libucxx.UCXXTag(tag(0, Kind.HANDSHAKE)))
        conn.sends.append((handshake, id_buf))
        conn.bye = ep.tag_recv(as_array(conn.bye_buf), libucxx.UCXXTag(tag(conn_id, Kind.BYE)))
        if not admitted:  # over the cap: the client reads this ERROR as the reply to its HELLO
            self._refuse(conn, ErrorCode.BUSY, self.admission.gate.busy_message)
            return
        self._post_header(conn)

    def _evict_oldest_stranger(self) -> bool:
        """Close the connection that has waited longest without authenticating, to make room
        for a new one (as the TCP listener does); False if none is left to close."""
        strangers = [
            c for c in self._conns.values()
            if c.admitted and not c.authenticated and c.closing_deadline is None
        ]  # fmt: skip
        if not strangers:
            return False
        oldest = min(strangers, key=lambda c: c.hello_deadline)
        logger.info("closing ucx connection %x: the oldest of %d unauthenticated connections",
                    oldest.id, len(strangers))  # fmt: skip
        self._refuse(oldest, ErrorCode.BUSY, EVICTED_MESSAGE)
        return True

    def _post_header(self, conn: UcxConn) -> None:
        # Zeroed so that a short (malformed) header message cannot replay the previous one.
        conn.header_buf[:] = bytes(HEADER_BYTES)
        conn.header = conn.control = None
        conn.body = conn.payload = None
        if conn.ticket is not None and conn.ticket.held:
            conn.sent_tickets.append(conn.ticket)  # its reply may still be leaving
            conn.reply_deadline = time.monotonic() + self.admission.frame_timeout
        conn.ticket = Ticket(self.admission.budget)
        conn.frame_deadline = None
        conn.recv = [
            conn.ep.tag_recv(
                as_array(conn.header_buf),
                self._libucxx.UCXXTag(tag(conn.id, Kind.REQUEST_HEADER)),
            )
        ]

    def _step(self, conn: UcxConn, now: float) -> bool:
        """Advance ``conn`` as far as its completed requests allow; True if anything moved."""
        busy = False
        try:
            for request, _ in conn.sends:
                if request.completed:
                    check_request(request, f"ucx send to {conn.id:x}")
            if any(r.completed for r, _ in conn.sends):
                conn.sends = [(r, b) for r, b in conn.sends if not r.completed]
                busy = True
            if not conn.sends and conn.sent_tickets:  # every reply left: its pages are free
                for ticket in conn.sent_tickets:
                    ticket.release()
                conn.sent_tickets.clear()
            if conn.closing_deadline is not None:
                if not conn.sends or now > conn.closing_deadline:
                    self._drop(conn)
                return busy
            if conn.bye.completed:
                self._drop(conn)
                return True
            if not conn.authenticated and now > conn.hello_deadline:
                raise ProtocolError("no HELLO in time")
            timeout = self.admission.frame_timeout
            if conn.frame_deadline is not None and now > conn.frame_deadline:
                raise ProtocolError(f"frame not received within {timeout:g} s of its header")
            if conn.sent_tickets and conn.reply_deadline is not None and now > conn.reply_deadline:
                raise ConnectionError(f"reply not taken within {timeout:g} s")
            if conn.wanted is not None:
                busy |= conn.retry_budget(self.admission, now)
            while conn.recv and all(r.completed for r in conn.recv):
                for r in conn.recv:
                    check_request(r, f"ucx receive from {conn.id:x}")
                busy = True
                self._advance(conn)
        except ProtocolError as exc:
            self.ops.counters["refused"] += 1
            logger.info("closing ucx connection %x: %s", conn.id, exc)
            self._refuse(conn, exc.code, str(exc))
        except ConnectionError as exc:
            logger.debug("ucx connection %x lost: %s", conn.id, exc)
            self._drop(conn)
        except Exception as exc:
            logger.exception("store failed serving ucx connection %x", conn.id)
            self._refuse(conn, ErrorCode.INTERNAL, f"store failure: {type(exc).__name__}: {exc}")
        return busy

    def _advance(self, conn: UcxConn) -> None:
        """The current phase's receives are all complete: take the next step of the frame."""
        limits = self.config.limits
        tags = self._libucxx.UCXXTag
        conn.recv = []
        if conn.header is None:
            header = decode_header(conn.header_buf, limits)
            if not conn.authenticated and header.op not in HANDSHAKE_OPS:
                raise ProtocolError(
                    f"the first frames must be HELLO and AUTH, got {header.op.name}"
                )
            conn.header = header
            conn.frame_deadline = time.monotonic() + self.admission.frame_timeout
            # Before any buffer of this frame exists: the bytes it may make us hold.
            need = self.admission.admit_header(header, conn.authenticated)
            conn.want(self.admission, need, header.op.name, lambda: self._post_control(conn))
            return
        header = conn.header
        if conn.control is None:
            assert conn.body is not None
            control = validate_request(header, unpack_control(conn.body), limits)
            conn.control, conn.body = map_control_keys(control, conn.grant), None
            if header.op is Op.GET:
                # The reply pins this many stored bytes until sent: charged before the lookup.
                need = sum(control["lengths"])
                conn.want(self.admission, need, "GET reply", lambda: self._finish(conn))
                return
            segments = payload_segments(header.op, control, reply=False)
            if segments and not control.get("shm"):
                # Allocated only now: the control map has been checked to declare exactly this.
                conn.payload = request_buffer(header.payload_len)
                view, offset, recvs = memoryview(conn.payload), 0, []
                for size in segments:
                    piece = view[offset : offset + size]
                    recvs.append(
                        conn.ep.tag_recv(as_array(piece), tags(tag(conn.id, Kind.REQUEST_PAYLOAD)))
                    )
                    offset += size
                conn.recv = recvs
                return
        self._finish(conn)

    def _post_control(self, conn: UcxConn) -> None:
        assert conn.header is not None
        conn.body = request_buffer(conn.header.control_len)
        kind = self._libucxx.UCXXTag(tag(conn.id, Kind.REQUEST_CONTROL))
        conn.recv = [conn.ep.tag_recv(as_array(conn.body), kind)]

    def _finish(self, conn: UcxConn) -> None:
        """The current frame is complete (and its budget held): serve it, await the next."""
        header, control = conn.header, conn.control
        assert header is not None and control is not None
        self.ops.counters["requests"] += 1
        self.ops.counters["bytes_in"] += HEADER_BYTES + header.control_len + header.payload_len
        self._dispatch(conn, header, control, conn.payload)
        self._post_header(conn)

    def _dispatch(
        self, conn: UcxConn, header: Header, control: dict[str, Any], payload: bytearray | None
    ) -> None:
        op = header.op
        if control.get("shm"):
            raise ProtocolError(f"{op.name}: shared memory is not offered over ucx://")
        if op is Op.SHM_ATTACH:  # meaningless without a shared segment
            raise ProtocolError(f"{op.name} is not offered over ucx://")
        handle = self.ops.handler(op)
        reply = run_now(handle(conn, control, memoryview(payload or b"")))
        views = [v for v in reply.pages if v.nbytes]  # an empty page sends no message
        self._send_frame(conn, op, header.request_id, reply.control, views)

    def _send_frame(
        self,
        conn: UcxConn,
        op: Op,
        request_id: int,
        control: dict[str, Any],
        views: list[memoryview],
        *,
        reply: bool = True,
    ) -> None:
        """Post the frame's sends; their buffers stay referenced in ``conn.sends`` until done
        (a GET's views pin the stored pages, so an eviction meanwhile cannot free them)."""
        tags = self._libucxx.UCXXTag
        head = memoryview(
            encode_head(op, request_id, control, sum(v.nbytes for v in views), reply=reply)
        )
        parts = [
            (head[:HEADER_BYTES], Kind.REPLY_HEADER),
            (head[HEADER_BYTES:], Kind.REPLY_CONTROL),
        ]
        parts += [(v, Kind.REPLY_PAYLOAD) for v in views]
        for data, kind in parts:
            request = conn.ep.tag_send(as_array(data), tags(tag(conn.id, kind)))
            conn.sends.append((request, data))
            self.ops.counters["bytes_out"] += data.nbytes

    def _refuse(self, conn: UcxConn, code: ErrorCode, message: str) -> None:
        """Send an ERROR, then close once it has left (or after :data:`REFUSE_GRACE_S`)."""
        request_id = conn.header.request_id if conn.header is not None else 0
        error = {"code": code.value, "message": message[:4096]}
        try:
            self._send_frame(conn, Op.ERROR, request_id, error, [])
        except Exception:
            self._drop(conn)
            return
        conn.closing_deadline = time.monotonic() + REFUSE_GRACE_S

    def _drop(self, conn: UcxConn) -> None:
        if self._conns.pop(conn.id, None) is None:
            return
        if conn.admitted:
            self.admission.gate.leave(conn.authenticated)
        conn.wanted = None
        with contextlib.suppress(Exception):
            # Not close(): that leaves the receives posted on the endpoint in place, so a
            # dropped connection kept its buffers (and their budget) for good. close_blocking
            # cancels them first; it returns at once for a peer that is gone (measured).
            conn.ep.close_blocking()
        self._dead.append(conn)  # its budget goes back once UCX is done with its buffers

    def _info(self) -> dict[str, Any]:
        """What STATS reports as ``server`` (read by the tests, on any thread: a snapshot)."""
        return self.ops.info()

    def _describe(self) -> dict[str, Any]:
        return {"url": self.url, "transport": "ucx", "connections": len(self._conns)}


def start_ucx_listener(
    store: PageStore,
    config: ServerConfig,
    host: str,
    port: int,
    on_stored: Callable[[list[bytes]], None] | None = None,
    admission: Admission | None = None,
) -> UcxListenerHandle:
    """Serve ``store`` (the caller owns and closes it, after closing the handle) over ucx://.

    ``config``: the TCP server's ``ServerConfig`` (reads ``token``, ``tenant_tokens``,
    ``limits``, ``hello_timeout``, ``info``, and its bounds unless ``admission`` is given:
    give the TCP server's budget, with a gate of this listener's own, so that both charge one
    in-flight budget; see :func:`banaserve.kvstore.server.cli.serve`).
    ``port`` 0 picks a free one (``handle.port``); the convention is the TCP port + 1.
    ``host`` only names the URL: UCX listens on every interface.
    ``on_stored(keys)``, called on the listener's thread after each PUT, must be thread-safe
    and quick (the TCP server's ``notify_stored`` ends the claims on those keys). Blocks
    until listening (ucxx start-up, well under a second after the first context); raises
    KvStoreError when ucxx is missing and OSError/UCX errors when the port cannot be had.
    """
    import_libucxx(f"ucx://{host}:{port}")
    handle = UcxListenerHandle(store, config, host, port, on_stored, admission)
    handle._thread.start()
    handle._ready.wait()
    if handle._error is not None:
        raise handle._error
    return handle
