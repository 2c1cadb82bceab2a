"""The KV store server in this process and the wire-level helpers its tests share."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading

import numpy as np
import pytest

from banaserve.kvstore.framing import Frame, FrameDecoder
from banaserve.kvstore.protocol import NONCE_BYTES, PROTOCOL_VERSION, Op, encode_frame
from banaserve.kvstore.server import KvStoreServer, ServerConfig
from banaserve.kvstore.storage import PageStore
from banaserve.kvstore.transport import shm
from store_hostile import handshake

TOKEN = "test-token-123"
PAGE = 4096


def keys_for(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def pages(n: int, size: int = PAGE, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def hello() -> bytes:
    """A HELLO frame with a fresh nonce (it authenticates nothing by itself)."""
    control = {"version": PROTOCOL_VERSION, "nonce": os.urandom(NONCE_BYTES)}
    return encode_frame(Op.HELLO, 1, control)


def exchange(url: str, data: bytes, token: str | None | bool = False) -> list[Frame]:
    """Send ``data`` on a raw socket, half-close, read until the server closes; the frames
    the server sent. With ``token`` not False, HELLO and AUTH with that token come first
    (their replies lead the list; a refused AUTH ends the exchange there)."""
    host, port = url.split("://")[-1].rsplit(":", 1)
    frames: list[Frame] = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        if token is not False:
            frames = handshake(sock, None if token is None else str(token))
            if frames[-1].op is Op.ERROR:
                return frames
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may refuse before reading it all
        received = bytearray()
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return frames + FrameDecoder(replies=True).feed(bytes(received))


class InProcessServer:
    """A KvStoreServer on an event loop in a background thread (for knobs the CLI lacks)."""

    def __init__(self, store: PageStore, config: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = KvStoreServer(store, config)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.url = self.server.url

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _spy_streamed(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records every pipelined (streamed) shm GET the client copies out."""
    streamed: list[bool] = []
    original = shm.ShmTransport._copy_as_ready

    def spy(self: shm.ShmTransport, *args: object) -> None:
        streamed.append(True)
        original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(shm.ShmTransport, "_copy_as_ready", spy)
    return streamed
