"""Decoding a byte stream into whole validated frames, without I/O (tests, fuzzers, and tools
that speak the protocol on raw sockets). The checks are :mod:`banaserve.kvstore.protocol`'s and
:mod:`banaserve.kvstore.op_specs`'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from banaserve.kvstore.op_specs import validate_reply, validate_request
from banaserve.kvstore.protocol import (
    HEADER_BYTES,
    Header,
    Limits,
    Op,
    ProtocolError,
    decode_header,
    unpack_control,
)

_LIMITS = Limits()


@dataclass
class Frame:
    """A decoded frame. ``op`` is the request op (the reply bit stripped) or ERROR."""

    op: Op
    request_id: int
    control: dict[str, Any]
    payload: bytes
    is_reply: bool


class FrameDecoder:
    """Incremental decoder over a byte stream: feed bytes, take whole validated frames.

    Pure (no I/O), so it can be driven by a fuzzer. ``replies`` chooses which side it decodes.
    Memory stays bounded: a header is bound-checked before its control map is buffered, and a
    control map is validated before its payload is buffered. After a ProtocolError the stream
    cannot be resynchronized; the decoder refuses further input.
    """

    def __init__(self, *, replies: bool = False, limits: Limits = _LIMITS) -> None:
        self.replies = replies
        self.limits = limits
        self._buf = bytearray()
        self._header: Header | None = None
        self._control: dict[str, Any] | None = None
        self._failed = False

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._failed:
            raise ProtocolError("decoder already failed; the connection must be closed")
        self._buf += data
        frames: list[Frame] = []
        try:
            while (frame := self._next()) is not None:
                frames.append(frame)
        except ProtocolError:
            self._failed = True
            raise
        return frames

    @property
    def pending(self) -> int:
        """Bytes buffered that do not yet make a whole frame."""
        return len(self._buf)

    @property
    def idle(self) -> bool:
        """True between frames: nothing of a next frame has arrived yet."""
        return not self._buf and self._header is None

    def _next(self) -> Frame | None:
        if self._header is None:
            if len(self._buf) < HEADER_BYTES:
                return None
            self._header = decode_header(bytes(self._buf[:HEADER_BYTES]), self.limits)
            del self._buf[:HEADER_BYTES]
        header = self._header
        if self._control is None:
            if len(self._buf) < header.control_len:
                return None
            control = unpack_control(bytes(self._buf[: header.control_len]))
            validate = validate_reply if self.replies else validate_request
            self._control = validate(header, control, self.limits)
            del self._buf[: header.control_len]
        if len(self._buf) < header.payload_len:
            return None
        payload = bytes(self._buf[: header.payload_len])
        del self._buf[: header.payload_len]
        frame = Frame(header.op, header.request_id, self._control, payload, header.is_reply)
        self._header = None
        self._control = None
        return frame


def decode_frames(data: bytes, *, replies: bool = False, limits: Limits = _LIMITS) -> list[Frame]:
    """Every whole frame in ``data``; trailing bytes that do not make a frame are an error."""
    decoder = FrameDecoder(replies=replies, limits=limits)
    frames = decoder.feed(data)
    if not decoder.idle:
        raise ProtocolError(f"truncated frame: {decoder.pending} bytes left over")
    return frames
