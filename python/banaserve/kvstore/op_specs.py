"""What each op's control maps must hold: one :class:`OpSpec` per :class:`Op`, in :data:`OP_SPECS`.

A spec lists, for the request and for the reply, the control fields and their bounds (checked
in that order), which list says how many payload bytes follow (the rest carry none), and which
lists have one entry per key of the request. The server validates requests
(:func:`validate_request`), both sides validate replies (:func:`validate_reply`), and the
client checks a reply's lists against its own request (:func:`reply_check`), all from this
table. The control maps themselves are documented on :class:`Op`.

Pure, like :mod:`banaserve.kvstore.protocol`: values in, values or ProtocolError out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from banaserve.kvstore.keys import KEY_BYTES
from banaserve.kvstore.protocol import (
    MAX_KEYS_PER_FRAME,
    MAX_LEASE_MS,
    MAX_OWNER_CHARS,
    MAX_WAIT_MS,
    MISSING,
    NONCE_BYTES,
    ErrorCode,
    Header,
    Limits,
    Op,
    ProtocolError,
)

Control = dict[str, Any]


class Rule(Protocol):
    """One check of a control map; raises ProtocolError naming ``op``."""

    def check(self, control: Control, op: Op, limits: Limits) -> None: ...


def _field(control: Control, name: str, kind: type | tuple[type, ...], op: Op) -> Any:
    if name not in control:
        raise ProtocolError(f"{op.name}: missing field {name!r}")
    value = control[name]
    # bool is an int in Python; a flag is never a count and a count is never a flag.
    if isinstance(value, bool) and kind in (int, (int,)):
        raise ProtocolError(f"{op.name}: field {name!r} must be int, got bool")
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ProtocolError(f"{op.name}: field {name!r} must be {want}, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Field:
    """A required field of one type (an int is never a bool)."""

    name: str
    kind: type

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        _field(control, self.name, self.kind, op)


@dataclass(frozen=True)
class Flag:
    """An optional bool."""

    name: str

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        if self.name in control:
            _field(control, self.name, bool, op)


@dataclass(frozen=True)
class Nonce:
    """Exactly NONCE_BYTES bytes; nil or left out too when ``optional``."""

    name: str
    optional: bool = False

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        if self.optional and control.get(self.name) is None:
            return
        value = _field(control, self.name, bytes, op)
        if len(value) != NONCE_BYTES:
            raise ProtocolError(f"{op.name}: {self.name!r} must be {NONCE_BYTES} bytes")


@dataclass(frozen=True)
class Bounded:
    """A required int in [lo, hi]."""

    name: str
    lo: int
    hi: int

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        value = _field(control, self.name, int, op)
        if not self.lo <= value <= self.hi:
            raise ProtocolError(
                f"{op.name}: {self.name!r} must be in [{self.lo}, {self.hi}], got {value}"
            )


class Keys:
    """``keys``: at most MAX_KEYS_PER_FRAME keys of KEY_BYTES bytes each."""

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        keys = _field(control, "keys", list, op)
        if len(keys) > MAX_KEYS_PER_FRAME:
            raise ProtocolError(f"{op.name}: {len(keys)} keys over {MAX_KEYS_PER_FRAME} per frame")
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                what = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
                raise ProtocolError(f"{op.name}: key {i} must be {KEY_BYTES} bytes, got {what}")


@dataclass(frozen=True)
class IntList:
    """A list of ints >= ``lo``; with ``per_key``, one per key (the keys checked before)."""

    name: str
    lo: int
    per_key: bool = True

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        values = _field(control, self.name, list, op)
        if self.per_key and len(values) != len(control["keys"]):
            n = len(control["keys"])
            raise ProtocolError(f"{op.name}: {self.name!r} has {len(values)} entries for {n} keys")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < self.lo:
                raise ProtocolError(
                    f"{op.name}: {self.name!r} entries must be ints >= {self.lo}, got {v!r}"
                )


@dataclass(frozen=True)
class BoolList:
    """A required list of bools."""

    name: str

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        if not all(isinstance(v, bool) for v in _field(control, self.name, list, op)):
            raise ProtocolError(f"{op.name}: {self.name!r} entries must be bools")


@dataclass(frozen=True)
class SameLength:
    """Two lists (checked before) of as many entries."""

    first: str
    second: str

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        a, b = len(control[self.first]), len(control[self.second])
        if a != b:
            raise ProtocolError(f"{op.name}: {a} {self.first!r} but {b} {self.second!r}")


@dataclass(frozen=True)
class WithinPayload:
    """The sum of a list (checked before) fits one frame's payload: else TOO_LARGE."""

    name: str

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        total = sum(control[self.name])
        if total > limits.max_payload:
            raise ProtocolError(
                f"{op.name} of {total} bytes over the payload limit {limits.max_payload}",
                ErrorCode.TOO_LARGE,
            )


class ByteRange:
    """``range``: nil or [offset >= 0, length > 0]."""

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        value = control.get("range")
        if value is None:
            return
        if (
            not isinstance(value, list)
            or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
            or value[0] < 0
            or value[1] <= 0
        ):
            raise ProtocolError(
                f"{op.name}: 'range' must be [offset >= 0, length > 0], got {value!r}"
            )


class Owner:
    """``owner``: a str of 1 to MAX_OWNER_CHARS characters."""

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        owner = _field(control, "owner", str, op)
        if not 0 < len(owner) <= MAX_OWNER_CHARS:
            raise ProtocolError(
                f"{op.name}: 'owner' must be 1 to {MAX_OWNER_CHARS} characters, got {len(owner)}"
            )


@dataclass(frozen=True)
class ShmSpec:
    """A segment request {size}: the map itself, or the optional field ``name``. The server
    creates and names the segment; a request that names one is refused (issue 31)."""

    name: str | None = None

    def check(self, control: Control, op: Op, limits: Limits) -> None:
        if self.name is None:
            spec = control
        elif control.get(self.name) is None:
            return
        else:
            spec = _field(control, self.name, dict, op)
        if "name" in spec:
            raise ProtocolError(
                f"{op.name}: the server names shared-memory segments; ask for a size only"
            )
        size = _field(spec, "size", int, op)
        if not 0 < size <= limits.max_payload:
            raise ProtocolError(
                f"{op.name}: shared-memory size {size} outside (0, {limits.max_payload}]"
            )


@dataclass(frozen=True)
class Side:
    """One direction of an op: its control fields (checked in order) and what follows them."""

    rules: tuple[Rule, ...] = ()
    #: The list whose positive entries are the sizes of the payload's pages, in order; None:
    #: no payload. With ``shm`` true the pages are in shared memory, and the frame has none.
    payload: str | None = None
    #: Lists with one entry per key of the request (of the reply only: the client checks).
    per_key: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpSpec:
    """What one op's request and reply carry."""

    #: None: a reply-only op (ERROR).
    request: Side | None
    reply: Side


_DEFAULT_LIMITS = Limits()
_KEYS = Keys()
_OWNER = Owner()

#: One entry per op.
OP_SPECS: dict[Op, OpSpec] = {
    Op.HELLO: OpSpec(
        Side((Field("version", int), Nonce("nonce"))),
        Side((Field("version", int), Nonce("nonce"))),
    ),
    Op.AUTH: OpSpec(
        Side((Nonce("proof", optional=True), ShmSpec("shm"))),
        Side((Field("version", int), Field("max_payload", int), Nonce("proof", optional=True))),
    ),
    Op.SHM_ATTACH: OpSpec(Side((ShmSpec(),)), Side()),
    Op.EXISTS: OpSpec(Side((_KEYS,)), Side((BoolList("present"),), per_key=("present",))),
    Op.GET: OpSpec(
        Side((_KEYS, IntList("lengths", 0), ByteRange(), Flag("shm"), WithinPayload("lengths"))),
        Side((IntList("sizes", MISSING, per_key=False), Flag("shm")), "sizes", ("sizes",)),
    ),
    Op.PUT: OpSpec(
        Side((_KEYS, IntList("sizes", 0), WithinPayload("sizes"), Flag("shm")), "sizes"),
        Side((BoolList("stored"),), per_key=("stored",)),
    ),
    Op.STATS: OpSpec(Side(), Side((Field("store", dict), Field("server", dict)))),
    Op.LOOKUP: OpSpec(
        Side(
            (
                _KEYS,
                _OWNER,
                Bounded("wait_ms", 0, MAX_WAIT_MS),
                Bounded("lease_ms", 1, MAX_LEASE_MS),
                Field("claim", bool),
            )
        ),
        Side(
            (BoolList("present"), BoolList("claimed"), SameLength("present", "claimed")),
            per_key=("present", "claimed"),
        ),
    ),
    Op.RELEASE: OpSpec(Side((_KEYS, _OWNER)), Side((BoolList("released"),), per_key=("released",))),
    Op.CLEAR: OpSpec(Side(), Side((Bounded("dropped", 0, 2**63 - 1),))),
    Op.ERROR: OpSpec(None, Side((Field("code", str), Field("message", str)))),
}


def _side(op: Op, *, reply: bool) -> Side:
    spec = OP_SPECS[op]
    side = spec.reply if reply else spec.request
    if side is None:
        raise ProtocolError(f"unknown op {op}")
    return side


def payload_segments(op: Op, control: Control, *, reply: bool) -> list[int]:
    """Sizes of the pages a validated control map says follow it, in order (zeros left out)."""
    name = _side(op, reply=reply).payload
    return [] if name is None else [s for s in control[name] if s > 0]


def payload_bytes(op: Op, control: Control, *, reply: bool) -> int:
    """Payload bytes a validated control map implies, wherever they travel (socket or shm).

    A PUT request carries ``sum(sizes)``; a GET reply carries the sum of the sizes of the keys
    it found. Every other frame carries none.
    """
    return sum(payload_segments(op, control, reply=reply))


def _validate(header: Header, control: Control, side: Side, limits: Limits) -> Control:
    op = header.op
    if side.payload is None and header.payload_len:
        raise ProtocolError(
            f"{op.name} carries no payload, header declares {header.payload_len} bytes"
        )
    for rule in side.rules:
        rule.check(control, op, limits)
    if side.payload is not None:
        in_shm = bool(control.get("shm"))
        expected = 0 if in_shm else payload_bytes(op, control, reply=header.is_reply)
        if header.payload_len != expected:
            where = " (the bytes are in shared memory)" if in_shm else ""
            raise ProtocolError(
                f"{op.name}: header declares {header.payload_len} payload bytes, "
                f"control {expected}{where}"
            )
    return control


def validate_request(header: Header, control: Control, limits: Limits = _DEFAULT_LIMITS) -> Control:
    """Check a request's control map against its op's spec and the header's payload length.

    Returns ``control`` unchanged. After this returns, every key is 32 bytes, every list has
    one entry per key, and the payload length is exactly what the control map implies.
    """
    if header.is_reply:
        raise ProtocolError(f"expected a request, got a reply ({header.op.name})")
    return _validate(header, control, _side(header.op, reply=False), limits)


def validate_reply(header: Header, control: Control, limits: Limits = _DEFAULT_LIMITS) -> Control:
    """Check a reply's control map; the client checks list lengths against its own request
    (:func:`reply_check`)."""
    if not header.is_reply:
        raise ProtocolError(f"expected a reply, got a request ({header.op.name})")
    return _validate(header, control, _side(header.op, reply=True), limits)


def reply_check(op: Op, n: int) -> Callable[[Control], None]:
    """A check of a validated ``op`` reply to a request of ``n`` keys: one entry per key in
    each of its per-key lists."""
    names = _side(op, reply=True).per_key

    def check(reply: Control) -> None:
        for name in names:
            if len(reply[name]) != n:
                raise ProtocolError(f"{op.name} reply has {len(reply[name])} {name} for {n} keys")

    return check
