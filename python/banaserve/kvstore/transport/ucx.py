"""``ucx://``: the KV store protocol over UCX tag messages (the optional extra ``banaserve[ucx]``).

Uses ucxx's low-level API (``ucxx._lib.libucxx``) with endpoint error handling off: the asyncio
API ignores that flag, and with it on UCX drops to TCP only (about 1.5 GB/s loopback against
about 11 GB/s with shared memory). With ucxx missing, :func:`open_ucx` raises KvStoreError
naming the extra.

Wire mapping of one frame (the same header, msgpack control and payload as ``tcp://``, see
:mod:`banaserve.kvstore.protocol`): three kinds of tag message, in order, on tags that carry the
connection id and the kind (:func:`tag`)::

    header (HEADER_BYTES) | control (control length bytes) | payload: one message per segment

Payload segments are canonical so that both sides post receives of the right sizes: one per
nonzero entry of the PUT request's ``sizes`` or of the GET reply's ``sizes``
(:func:`banaserve.kvstore.op_specs.payload_segments`). A segment that falls inside one caller
buffer goes straight from or into it (zero copy); one that spans several buffers (a page given
as several segments) goes through a bounce buffer.

UCX tag matching is per worker, not per endpoint, so a server tells its connections apart by a
random 56-bit connection id in every tag. The server sends that id first (:data:`Kind.HANDSHAKE`)
and the client announces itself with a one-byte :data:`Kind.KNOCK`, whose send fails at once
(``Endpoint is not connected``) when nobody listens, so a down server is an OSError right away
rather than a timeout. Without error handling UCX cannot tell a server that a client died; a
client says :data:`Kind.BYE` when it closes so the server frees the connection.

Transports: ``UCX_TLS`` defaults to ``sm,tcp`` (shared memory on one host, TCP across hosts; the
PyPI libucx has no RDMA, and skipping the CUDA transports makes start-up fast) unless the
environment already sets it; it is read when the process's UCX context is created.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from banaserve.kvstore.op_specs import payload_segments, validate_reply
from banaserve.kvstore.protocol import (
    HEADER_BYTES,
    Limits,
    Op,
    ProtocolError,
    decode_header,
    encode_head,
    unpack_control,
)
from banaserve.kvstore.transport.base import Address, KvStoreError, Sink, Transport
from banaserve.kvstore.transport.tcp import _remote_error

UCX_EXTRA_HINT = "ucx:// needs the optional extra banaserve[ucx] (pip install 'banaserve[ucx]')"
DEFAULT_UCX_TLS = "sm,tcp"

#: Bits of a tag below the connection id: the message kind.
KIND_BITS = 8
#: Connection ids are random and this wide (tags are 64 bits); hard to guess, so a stranger
#: cannot inject frames into an authenticated connection's tag space.
CONN_ID_BITS = 56
#: Blocking waits poll UCX this many times before sleeping in epoll: a reply that comes back
#: within microseconds skips two syscalls and a wake-up, while a slow one costs little CPU.
SPIN_POLLS = 200
#: Longest single epoll sleep, so deadlines and stop flags are seen promptly.
EPOLL_SLICE_MS = 100


class Kind(enum.IntEnum):
    """What a tag message carries (the low :data:`KIND_BITS` of its tag)."""

    HANDSHAKE = 1  # server -> client, connection id 0: the 8-byte little-endian connection id
    KNOCK = 2  # client -> server, connection id 0: one byte, drained by the server
    REQUEST_HEADER = 3
    REQUEST_CONTROL = 4
    REQUEST_PAYLOAD = 5
    REPLY_HEADER = 6
    REPLY_CONTROL = 7
    REPLY_PAYLOAD = 8
    BYE = 9  # client -> server: one byte, the client closes this connection


def tag(conn_id: int, kind: Kind) -> int:
    return (conn_id << KIND_BITS) | int(kind)


def carve(segments: Sequence[int], views: Sequence[memoryview]) -> list[list[memoryview]]:
    """Split ``views`` (flat bytes, in order) into the pieces that make up each segment.

    The sizes must add up to the same total (the caller checks). A segment inside one view
    gets one piece (a slice of it: no copy); one that spans views gets several.
    """
    flat = [v for v in (memoryview(v).cast("B") for v in views) if v.nbytes]
    out: list[list[memoryview]] = []
    i, offset = 0, 0
    for size in segments:
        pieces: list[memoryview] = []
        while size:
            view = flat[i]
            take = min(size, view.nbytes - offset)
            pieces.append(view[offset : offset + take])
            size -= take
            offset += take
            if offset == view.nbytes:
                i, offset = i + 1, 0
        out.append(pieces)
    return out


# -- the process's UCX context ----------------------------------------------------------------

_context_lock = threading.Lock()
_context: tuple[int, Any] | None = None  # (pid, UCXContext): a forked child makes its own


def import_libucxx(url: str = "ucx://") -> Any:
    """``ucxx._lib.libucxx``; KvStoreError naming the extra when ucxx is not installed."""
    os.environ.setdefault("UCX_TLS", DEFAULT_UCX_TLS)
    # ucxx itself exports UCX_MEMTYPE_CACHE, which this libucx no longer reads and warns about
    # on stderr at every context; the warning says nothing about BanaServe's settings.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx._lib.libucxx as libucxx
    except ImportError as exc:
        raise KvStoreError(f"{url}: {UCX_EXTRA_HINT}; use tcp:// or shm://") from exc
    return libucxx


def ucx_context() -> Any:
    """The process-wide UCX context (tag matching and wake-up events), created on first use.

    Thread-safe. Workers made from it are not: each belongs to one thread at a time.
    """
    global _context
    libucxx = import_libucxx()
    with _context_lock:
        if _context is None or _context[0] != os.getpid():
            ctx = libucxx.UCXContext(feature_flags=(libucxx.Feature.TAG, libucxx.Feature.WAKEUP))
            _context = (os.getpid(), ctx)
        return _context[1]


def new_worker() -> Any:
    """A worker in blocking progress mode (epoll on its event fd when idle)."""
    libucxx = import_libucxx()
    worker = libucxx.UCXWorker(ucx_context())
    worker.init_blocking_progress_mode()
    return worker


def wait_requests(worker: Any, requests: Sequence[Any], deadline: float, what: str) -> None:
    """Progress ``worker`` until every request completed, or raise TimeoutError at ``deadline``.

    Blocks the calling thread, which must be the worker's only user. Completed requests with an
    error raise through :func:`check_request`.
    """
    polls = 0
    while not all(r.completed for r in requests):
        if polls < SPIN_POLLS:
            worker.progress()
            polls += 1
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: timed out")
        worker.progress_worker_event(epoll_timeout=max(1, min(int(left * 1000), EPOLL_SLICE_MS)))
    for r in requests:
        check_request(r, what)


def check_request(request: Any, what: str) -> None:
    """Raise a completed request's error: ProtocolError for a message bigger than its buffer
    (the peer broke the framing), ConnectionError (an OSError) for anything else."""
    libucxx = import_libucxx()
    try:
        request.check_error()
    except libucxx.UCXMessageTruncatedError as exc:
        raise ProtocolError(f"{what}: message larger than expected ({exc})") from None
    except libucxx.UCXError as exc:
        raise ConnectionError(f"{what}: {type(exc).__name__}: {exc}") from None


def as_array(view: bytes | bytearray | memoryview) -> Any:
    """ucxx's buffer wrapper around ``view``.

    A UCXRequest does NOT keep its buffer alive: whoever posts a request must hold the buffer
    until the request has completed (or was cancelled), or UCX writes into freed memory.
    """
    from ucxx._lib.arr import Array

    return Array(view)


# -- the client transport ---------------------------------------------------------------------


class UcxTransport(Transport):
    """One UCX endpoint to one store server, on a worker of its own. See :class:`Transport`.

    Not thread-safe (like every transport): one thread drives it at a time, and that thread
    progresses the worker inside each call; no background thread. ``timeout`` bounds each wait
    (connect, each reply phase). Payload views are only used until the call returns: every send
    has completed by then, and a reply payload lands in the sink's views (zero copy unless a
    page spans several of them).
    """

    def __init__(self, address: Address, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self.max_payload = Limits().max_payload
        self._libucxx = import_libucxx(address.url)
        self._worker: Any = None
        self._ep: Any = None
        self._conn_id = 0
        self._request_id = 0
        self._header = bytearray(HEADER_BYTES)

    @property
    def connected(self) -> bool:
        return self._ep is not None

    def connect(self, token: str | None) -> dict[str, Any]:
        libucxx = self._libucxx
        what = f"kv store at {self.address.url}"
        try:
            self._worker = new_worker()
            self._ep = libucxx.UCXEndpoint.create(
                self._worker, self.address.host, self.address.port, endpoint_error_handling=False
            )
            id_buf = bytearray(8)
            recv = self._ep.tag_recv(as_array(id_buf), libucxx.UCXXTag(tag(0, Kind.HANDSHAKE)))
            knock_buf = bytearray(1)  # held until the send completes (see as_array)
            knock = self._ep.tag_send(as_array(knock_buf), libucxx.UCXXTag(tag(0, Kind.KNOCK)))
            # The knock completes (or fails: nobody listens) long before the handshake.
            deadline = time.monotonic() + self.timeout
            wait_requests(self._worker, [knock], deadline, f"{what}: connect")
            wait_requests(self._worker, [recv], deadline, f"{what}: handshake")
            del knock_buf
            self._conn_id = int.from_bytes(id_buf, "little")
        except BaseException:
            self.close()
            raise
        return self._authenticate(token)

    def request(
        self,
        op: Op,
        control: dict[str, Any],
        payload: Sequence[memoryview] = (),
        sink: Sink | None = None,
        reply_capacity: int = 0,
    ) -> dict[str, Any]:
        if self._ep is None:
            raise ConnectionError(f"kv store at {self.address.url}: not connected")
        try:
            return self._request(op, control, payload, sink)
        except BaseException:
            # The message stream's position is unknown now: never reuse this endpoint.
            self.close()
            raise

    def _request(
        self, op: Op, control: dict[str, Any], payload: Sequence[memoryview], sink: Sink | None
    ) -> dict[str, Any]:
        libucxx, ep, worker = self._libucxx, self._ep, self._worker
        what = f"kv store at {self.address.url}: {op.name}"
        self._request_id += 1
        request_id = self._request_id
        total = sum(v.nbytes for v in payload)
        head = encode_head(op, request_id, control, total)
        segments = payload_segments(op, control, reply=False)
        if sum(segments) != total:
            raise ValueError(f"{op.name}: {total} payload bytes for a control map of {segments}")

        def send(data: Any, kind: Kind) -> Any:
            return ep.tag_send(as_array(data), libucxx.UCXXTag(tag(self._conn_id, kind)))

        # Post the reply's header receive first so it never waits in the unexpected queue.
        self._header[:] = bytes(HEADER_BYTES)
        header_recv = ep.tag_recv(
            as_array(self._header), libucxx.UCXXTag(tag(self._conn_id, Kind.REPLY_HEADER))
        )
        head_view = memoryview(head)
        sends = [
            send(head_view[:HEADER_BYTES], Kind.REQUEST_HEADER),
            send(head_view[HEADER_BYTES:], Kind.REQUEST_CONTROL),
        ]
        # Buffers of posted requests, held until they complete (see as_array).
        keep: list[Any] = [head_view]
        for pieces in carve(segments, payload):
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            keep.append(data)
            sends.append(send(data, Kind.REQUEST_PAYLOAD))

        deadline = time.monotonic() + self.timeout
        wait_requests(worker, [header_recv], deadline, what)
        header = decode_header(self._header, Limits(max_payload=1 << 62))
        body = bytearray(header.control_len)
        control_recv = ep.tag_recv(
            as_array(body), libucxx.UCXXTag(tag(self._conn_id, Kind.REPLY_CONTROL))
        )
        wait_requests(worker, [control_recv], time.monotonic() + self.timeout, what)
        reply = validate_reply(header, unpack_control(body))
        if header.op is Op.ERROR:
            raise _remote_error(self.address.url, reply)
        if header.op is not op or header.request_id != request_id:
            raise ProtocolError(
                f"reply {header.op.name}#{header.request_id} to request {op.name}#{request_id}"
            )
        if header.payload_len:
            self._receive_payload(header.op, reply, header.payload_len, sink, what)
        # Sends finished long ago in practice; waiting keeps the caller's buffers ours no longer.
        wait_requests(worker, sends, time.monotonic() + self.timeout, what)
        del keep
        return reply

    def _receive_payload(
        self, op: Op, reply: dict[str, Any], nbytes: int, sink: Sink | None, what: str
    ) -> None:
        if sink is None:
            raise ProtocolError(f"unexpected reply payload of {nbytes} bytes")
        targets = sink(reply)
        if sum(t.nbytes for t in targets) != nbytes:
            raise ProtocolError(
                f"reply payload of {nbytes} bytes does not match the "
                f"{sum(t.nbytes for t in targets)} bytes of buffers for it"
            )
        segments = payload_segments(op, reply, reply=True)
        recv_tag = self._libucxx.UCXXTag(tag(self._conn_id, Kind.REPLY_PAYLOAD))
        recvs, bounced = [], []
        for pieces in carve(segments, targets):
            if len(pieces) == 1:
                into = pieces[0]
            else:
                into = memoryview(bytearray(sum(p.nbytes for p in pieces)))
                bounced.append((into, pieces))
            recvs.append(self._ep.tag_recv(as_array(into), recv_tag))
        wait_requests(self._worker, recvs, time.monotonic() + self.timeout, what)
        for into, pieces in bounced:
            offset = 0
            for piece in pieces:
                piece[:] = into[offset : offset + piece.nbytes]
                offset += piece.nbytes

    def close(self) -> None:
        ep, worker, self._ep, self._worker = self._ep, self._worker, None, None
        if ep is None:
            return
        try:
            if self._conn_id:
                bye_buf = bytearray(1)
                bye = ep.tag_send(
                    as_array(bye_buf), self._libucxx.UCXXTag(tag(self._conn_id, Kind.BYE))
                )
                # A one-byte eager send: done locally at once, unless the peer is gone.
                deadline = time.monotonic() + 0.2
                while not bye.completed and time.monotonic() < deadline:
                    worker.progress()
            # Cancelled before returning: a receive into a caller's buffer must not land later.
            worker.cancel_inflight_requests(period=10_000_000, max_attempts=10)
            ep.close()
            worker.progress()
        except Exception:  # never raises: the endpoint is dropped either way
            pass
        self._conn_id = 0


def open_ucx(address: Address, timeout: float) -> Transport:
    """An unconnected :class:`UcxTransport`; KvStoreError when ucxx is not installed."""
    return UcxTransport(address, timeout)
