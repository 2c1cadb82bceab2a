"""The KV store wire protocol: a fixed binary header, a msgpack control map, raw payload bytes.

Frame layout (little endian)::

    magic "BKVS" | version u16 | op u16 | request id u64 | control length u32 | payload length u64
    control: ``control length`` bytes of msgpack (a map with str keys)
    payload: ``payload length`` raw bytes (page bytes, concatenated in key order)

A reply carries the request's op with :data:`REPLY_BIT` set and the same request id, or
:attr:`Op.ERROR`. Every length is checked against :class:`Limits` before anything is allocated,
and a control map is checked against its op's schema (types, 32-byte keys, list lengths, and the
payload length it implies) before the payload is read. So a peer learns how many bytes to
expect, and where they go, from a control map that is already known to be well formed.

Each op's control maps are checked against its entry in
:data:`banaserve.kvstore.op_specs.OP_SPECS`. Everything here and there is pure (bytes in,
values or :class:`ProtocolError` out), so it can be fuzzed; the server, the transports and
:class:`~banaserve.kvstore.framing.FrameDecoder` all validate through the same functions.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

MAGIC = b"BKVS"
#: 2: the token never travels (HELLO exchanges nonces, AUTH proves it both ways).
PROTOCOL_VERSION = 2
#: Bytes of each side's HELLO nonce and of each AUTH proof (HMAC-SHA256).
NONCE_BYTES = 32
HEADER = struct.Struct("<4sHHQIQ")
HEADER_BYTES = HEADER.size
REPLY_BIT = 0x80

MAX_CONTROL_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
#: Keys per frame; a client splits bigger batches. 16384 keys stay far below the control limit.
MAX_KEYS_PER_FRAME = 16384
#: Longest shared-memory segment name accepted (POSIX allows 255 with the leading slash).

#: GET reply size of a key that is missing (or not of the requested length).
MISSING = -1

#: Longest a LOOKUP may wait for claimed keys, and longest lease it may take, in ms.
MAX_WAIT_MS = 120_000
MAX_LEASE_MS = 120_000
#: Longest claim owner name (an instance or request id), in characters.
MAX_OWNER_CHARS = 256


class Op(enum.IntEnum):
    """Operations, with their control maps (request -> reply). Keys are 32-byte bins.

    HELLO       {version, nonce: 32 bytes} -> {version, server, nonce: 32 bytes}. The first
                frame of every connection: the client's and the server's fresh nonces.
    AUTH        {proof: 32 bytes|nil, shm?: {size}} -> {version, server, max_payload,
                shm: {name, size}|false, tenant: str|nil, proof: 32 bytes|nil}. The second
                frame: the client proves it holds a token without sending it (``proof`` is an
                HMAC of both nonces keyed by the token's digest, see
                :mod:`banaserve.kvstore.auth`; nil without a token), and the server proves
                it holds the same token in its reply (nil for a store without tokens), so a
                process that took the store's port learns nothing it can use. A proof that
                matches no token is an AUTH error. ``max_payload``: the most payload one
                frame of this client may carry (it splits bigger batches). ``tenant``: the
                tenant a per-tenant token grants; the server then maps every key of this
                connection into that tenant's keyspace.
    SHM_ATTACH  {size} -> {name, size}: replace this connection's shared-memory segment. The
                server creates each segment and names it; the client maps it by that name
                and removes the name (see :mod:`banaserve.kvstore.segments`).
    EXISTS      {keys} -> {present: [bool]}.
    GET         {keys, lengths: [int], range: [offset, length]|nil, shm?: bool} ->
                {sizes: [int], shm?: bool} + the found pages' bytes in key order. ``range``
                applies to every page; a page is sent only if exactly ``lengths[i]`` bytes
                result, else its size is MISSING.
    PUT         {keys, sizes: [int], shm?: bool} + sum(sizes) bytes -> {stored: [bool]}.
    STATS       {} -> {store: StoreStats fields, server: {...}}.
    LOOKUP      {keys, owner: str, wait_ms: int, lease_ms: int, claim: bool} ->
                {present: [bool], claimed: [bool]}. In-flight prefix coalescing (see
                :mod:`banaserve.kvstore.claims`): walks ``keys`` (a chained prefix) in order; a
                key that is not stored but claimed by another owner is waited on until it is
                stored, its claim ends, or ``wait_ms`` after the request arrived (one deadline
                for the request). Waiting stops at the first key still missing; with ``claim``
                every key from there on that is neither stored nor validly claimed by another
                owner is claimed for ``owner`` for ``lease_ms`` (the same owner renews), and
                after a wait that ran out (``wait_ms`` > 0) so are the keys another owner did
                not deliver in time. ``claimed[i]``: ``owner`` now holds key i.
                0 <= wait_ms <= MAX_WAIT_MS, 0 < lease_ms <= MAX_LEASE_MS,
                0 < len(owner) <= MAX_OWNER_CHARS.
    RELEASE     {keys, owner: str} -> {released: [bool]}: end ``owner``'s claims on ``keys``
                (a computation given up), waking whoever waits on them.
    CLEAR       {} -> {dropped: int}: drop every stored page (every tier) and every claim,
                waking the claims' waiters; ``dropped``: the pages dropped. Needs the shared
                token (or a store without tokens): a tenant token's CLEAR is an AUTH error,
                since pages do not record their tenant and the whole keyspace is not its own.
    ERROR       (reply only) {code: ErrorCode value, message}; the server then closes.

    With ``shm`` true the payload bytes sit at offset 0 of the connection's segment and the
    header's payload length is 0.
    """

    HELLO = 1
    EXISTS = 2
    GET = 3
    PUT = 4
    STATS = 5
    SHM_ATTACH = 6
    LOOKUP = 7
    RELEASE = 8
    CLEAR = 9
    AUTH = 10
    ERROR = 0xFF


REQUEST_OPS = frozenset(op for op in Op if op is not Op.ERROR)
#: What a connection may send before AUTH has succeeded.
HANDSHAKE_OPS = frozenset((Op.HELLO, Op.AUTH))
_REQUEST_VALUES = frozenset(int(op) for op in REQUEST_OPS)


class ErrorCode(str, enum.Enum):
    """Why a server refused a request; carried in an ERROR reply's control map."""

    PROTOCOL = "protocol"  # malformed frame: a client bug or a stranger on the port
    AUTH = "auth"  # wrong or missing token
    TOO_LARGE = "too_large"  # a length over the server's limits
    BUSY = "busy"  # the server is at a connection or memory bound; retry later
    SHM = "shm"  # the shared-memory segment cannot be used (not the same host?)
    INTERNAL = "internal"  # the store failed; the request may succeed later


class ProtocolError(Exception):
    """A frame or control map that breaks the protocol. ``code`` is what an ERROR reply says."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    """Upper bounds a decoder enforces before allocating anything."""

    max_control: int = MAX_CONTROL_BYTES
    max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES


@dataclass(frozen=True)
class Header:
    """A decoded frame header, its lengths already within :class:`Limits`."""

    op: Op
    request_id: int
    control_len: int
    payload_len: int
    is_reply: bool


# -- encoding ---------------------------------------------------------------------------------


def reply_op(op: Op) -> int:
    return op if op is Op.ERROR else op | REPLY_BIT


def encode_head(
    op: Op,
    request_id: int,
    control: dict[str, Any],
    payload_len: int = 0,
    *,
    reply: bool = False,
) -> bytes:
    """Header and control bytes of a frame; the caller sends ``payload_len`` payload bytes after.

    Raises ProtocolError if the control map is over the limit (a caller bug, checked here so
    that a peer never has to refuse it).
    """
    body = msgpack.packb(control, use_bin_type=True)
    if len(body) > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control map of {len(body)} bytes over {MAX_CONTROL_BYTES}")
    wire_op = reply_op(op) if reply else int(op)
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, wire_op, request_id, len(body), payload_len) + body


def encode_frame(
    op: Op, request_id: int, control: dict[str, Any], payload: bytes = b"", *, reply: bool = False
) -> bytes:
    """A whole frame in one ``bytes`` (tests and small messages; data paths send views)."""
    return encode_head(op, request_id, control, len(payload), reply=reply) + payload


def encode_error(request_id: int, code: ErrorCode, message: str) -> bytes:
    return encode_head(Op.ERROR, request_id, {"code": code.value, "message": message[:4096]})


# -- decoding ---------------------------------------------------------------------------------


def decode_header(data: bytes | bytearray | memoryview, limits: Limits = Limits()) -> Header:
    """Parse and bound-check a header (``HEADER_BYTES`` bytes)."""
    if len(data) != HEADER_BYTES:
        raise ProtocolError(f"header must be {HEADER_BYTES} bytes, got {len(data)}")
    magic, version, wire_op, request_id, control_len, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a banaserve kv store frame")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} not supported (this side speaks {PROTOCOL_VERSION})"
        )
    if wire_op == Op.ERROR:
        op, is_reply = Op.ERROR, True
    elif wire_op & ~REPLY_BIT in _REQUEST_VALUES:
        op, is_reply = Op(wire_op & ~REPLY_BIT), bool(wire_op & REPLY_BIT)
    else:
        raise ProtocolError(f"unknown op {wire_op}")
    if control_len > limits.max_control:
        raise ProtocolError(
            f"control length {control_len} over the limit {limits.max_control}", ErrorCode.TOO_LARGE
        )
    if payload_len > limits.max_payload:
        raise ProtocolError(
            f"payload length {payload_len} over the limit {limits.max_payload}", ErrorCode.TOO_LARGE
        )
    return Header(op, request_id, control_len, payload_len, is_reply)


def unpack_control(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """msgpack bytes -> a map with str keys; anything else is a ProtocolError."""
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            # Bounds on top of the byte limit so a tiny map cannot expand into a huge object.
            max_bin_len=MAX_CONTROL_BYTES,
            max_str_len=MAX_CONTROL_BYTES,
            max_array_len=MAX_KEYS_PER_FRAME,
            max_map_len=256,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, TypeError ...)
        raise ProtocolError(f"malformed msgpack control map: {type(exc).__name__}: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"control must be a map, got {type(value).__name__}")
    return value
