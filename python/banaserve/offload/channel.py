"""The offload's two transports: one message each way per layer, request then answer.

:class:`ShmChannel` (the default): a memfd mapping with one area per direction and an eventfd
per direction. The sender encodes into its area, stores a new sequence number at the area's
head, then writes its eventfd. The receiver spins on the sequence number for ``spin_s`` (an
answer that comes within it costs no sleep and wake-up), then blocks on the eventfd. Nothing
has a name: the mapping and the eventfds reach the worker as inherited file descriptors, so
no other process can map or guess them, and nothing is left in ``/dev/shm`` when either side
dies. :class:`SocketChannel` sends the same bytes over a stream socket, length-prefixed
(the transport to compare with, and the one that crosses hosts).

Contract: one sender and one receiver per direction, strictly alternating (a request, then its
answer); :meth:`recv`'s tensors view the channel's buffer and are valid until the next
:meth:`recv` on this side. Only :meth:`recv` blocks, at most ``timeout_s``.
"""

from __future__ import annotations

import mmap
import os
import platform
import select
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from banaserve.offload.wire import decode, encode

_SEQ = struct.Struct("<Q")
_HEAD = 64  # an area's sequence number, alone on its cache line
#: Seconds a receiver spins before it blocks. An answer within it skips a sleep and wake-up
#: (tens of microseconds on a loaded core, benchmark/offload_roundtrip.py); longer spins burn
#: the waiting core. The spin reads the sequence number without a fence, so only on x86,
#: whose stores are seen in order; elsewhere every wait goes through the eventfd.
SPIN_S = 50e-6 if platform.machine() in ("x86_64", "AMD64") else 0.0


class Channel(Protocol):
    def send(self, header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> None: ...

    def recv(self, timeout_s: float | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The next message; ``TimeoutError`` after ``timeout_s`` (None: wait for ever)."""
        ...

    def close(self) -> None: ...


class ShmChannel:
    """One end of a shared-memory channel (see the module's text). Create the pair's first
    end with :meth:`create`, hand :meth:`fds` to the other process (``pass_fds``), which opens
    its end with :meth:`attach` and the same numbers in swapped roles."""

    def __init__(self, memfd: int, area_bytes: int, out_index: int, out_efd: int, in_efd: int,
                 spin_s: float = SPIN_S) -> None:  # fmt: skip
        self.memfd, self.area_bytes, self.spin_s = memfd, area_bytes, spin_s
        self.out_efd, self.in_efd = out_efd, in_efd
        self._map = mmap.mmap(memfd, 2 * area_bytes)
        view = memoryview(self._map)
        self._out = view[out_index * area_bytes : (out_index + 1) * area_bytes]
        self._in = view[(1 - out_index) * area_bytes : (2 - out_index) * area_bytes]
        self._sent = 0
        self._seen = _SEQ.unpack_from(self._in, 0)[0]

    @classmethod
    def create(cls, area_bytes: int, spin_s: float = SPIN_S) -> ShmChannel:
        """The client's end of a new channel, ``area_bytes`` per direction."""
        area_bytes = -(-area_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        memfd = os.memfd_create("banaserve-offload", os.MFD_CLOEXEC)
        os.ftruncate(memfd, 2 * area_bytes)
        to_worker = os.eventfd(0, os.EFD_CLOEXEC)
        to_client = os.eventfd(0, os.EFD_CLOEXEC)
        return cls(memfd, area_bytes, 0, to_worker, to_client, spin_s)

    def fds(self) -> tuple[int, int, int]:
        """(memfd, the eventfd this end writes, the one it reads), for the other end."""
        return self.memfd, self.out_efd, self.in_efd

    @classmethod
    def attach(cls, memfd: int, area_bytes: int, in_efd: int, out_efd: int,
               spin_s: float = SPIN_S) -> ShmChannel:  # fmt: skip
        """The worker's end: ``in_efd`` is the one the client writes."""
        return cls(memfd, area_bytes, 1, out_efd, in_efd, spin_s)

    def send(self, header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> None:
        encode(self._out[_HEAD:], header, tensors)
        self._sent += 1
        _SEQ.pack_into(self._out, 0, self._sent)
        os.eventfd_write(self.out_efd, 1)

    def recv(self, timeout_s: float | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        start = time.perf_counter()
        spin_until = start + self.spin_s
        while True:
            seq = _SEQ.unpack_from(self._in, 0)[0]
            if seq != self._seen:
                self._seen = seq
                return decode(self._in[_HEAD:])
            now = time.perf_counter()
            if now < spin_until:
                continue
            left = None if timeout_s is None else timeout_s - (now - start)
            if left is not None and left <= 0:
                raise TimeoutError(f"no message within {timeout_s} s")
            ready, _, _ = select.select([self.in_efd], [], [], left)
            if ready:  # this also drains a count left by a message the spin took
                os.eventfd_read(self.in_efd)

    def close(self) -> None:
        self._out.release()
        self._in.release()
        try:
            self._map.close()
        except BufferError:  # a received tensor still views it: unmapped when that goes
            pass
        for fd in (self.memfd, self.out_efd, self.in_efd):
            try:
                os.close(fd)
            except OSError:
                pass


_LEN = struct.Struct("<Q")


class SocketChannel:
    """One end of a stream socket carrying :mod:`.wire` messages, each length-prefixed."""

    def __init__(self, sock: socket.socket, max_bytes: int) -> None:
        self.sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._out = bytearray(max_bytes)
        self._in = bytearray(max_bytes)

    def send(self, header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> None:
        n = encode(memoryview(self._out), header, tensors)
        self.sock.sendall(_LEN.pack(n) + self._out[:n])

    def recv(self, timeout_s: float | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """As :meth:`Channel.recv`; a message that stops half way (a timeout inside it, or the
        other end gone) raises ``ConnectionError``: the stream can no longer be read."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        prefix = memoryview(bytearray(_LEN.size))
        if not self._read(prefix, deadline, whole=False):
            raise TimeoutError(f"no message within {timeout_s} s")
        (n,) = _LEN.unpack(prefix)
        if n > len(self._in):
            raise ConnectionError(f"a {n}-byte message exceeds this channel's {len(self._in)}")
        self._read(memoryview(self._in)[:n], deadline, whole=True)
        return decode(memoryview(self._in))

    def _read(self, into: memoryview, deadline: float | None, whole: bool) -> bool:
        """Fill ``into``; False if the deadline passed before its first byte (unless
        ``whole``), ``ConnectionError`` if it passed after."""
        got = 0
        while got < len(into):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.sock.settimeout(left)
            try:
                n = self.sock.recv_into(into[got:])
            except (TimeoutError, BlockingIOError):
                if got == 0 and not whole:
                    return False
                raise ConnectionError("an offload message stopped half way") from None
            except OSError as exc:
                raise ConnectionError(f"the offload socket failed: {exc}") from exc
            if n == 0:
                raise ConnectionError("the other end closed the offload socket")
            got += n
        return True

    def close(self) -> None:
        self.sock.close()
