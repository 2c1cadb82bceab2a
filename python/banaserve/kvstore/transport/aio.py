"""asyncio socket helpers for the server side: exact reads into caller buffers and gather
writes from caller buffers, on non-blocking sockets (no stream-buffer copies).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

from banaserve.kvstore.transport.tcp import _IOV_MAX


class PeerClosed(ConnectionResetError):
    """The peer closed in the middle of a frame."""


async def recv_exact_into(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview, *, eof_ok: bool = False
) -> bool:
    """Fill ``view``; False only if ``eof_ok`` and the peer closed before sending a byte.

    A close after the first byte (a truncated frame) raises :class:`PeerClosed`.
    """
    filled, total = 0, view.nbytes
    while filled < total:
        n = await loop.sock_recv_into(sock, view[filled:])
        if n == 0:
            if eof_ok and filled == 0:
                return False
            raise PeerClosed(f"peer closed with {total - filled} of {total} bytes unsent")
        filled += n
    return True


async def send_views(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, views: Sequence[bytes | memoryview]
) -> int:
    """Send every view in order (gather writes); returns the bytes sent. Views are only read."""
    pending = [memoryview(v).cast("B") for v in views if len(v)]
    total = sum(v.nbytes for v in pending)
    while pending:
        try:
            sent = sock.sendmsg(pending[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock)
            continue
        while sent and sent >= pending[0].nbytes:
            sent -= pending[0].nbytes
            pending.pop(0)
        if sent:
            pending[0] = pending[0][sent:]
    return total


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    future: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not future.done():
            future.set_result(None)

    loop.add_writer(fd, ready)
    try:
        await future
    finally:
        loop.remove_writer(fd)
