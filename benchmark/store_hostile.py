"""Tools for hostile clients against a real store server process: starting it, its memory and
sockets as the kernel sees them, a STATS monitor, and raw non-blocking peers. The patterns
built from them are :mod:`store_hostile_patterns`.

The server's peak memory is the kernel's high-water mark (``VmHWM``), reset before a pattern
(``/proc/PID/clear_refs``), so no peak between two samples is missed.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgpack

import banaserve
from banaserve.env import SERVER_PATH_ENV, TENANT_TOKENS_ENV, TOKEN_ENV
from banaserve.kvstore.auth import client_proof
from banaserve.kvstore.framing import Frame, FrameDecoder
from banaserve.kvstore.protocol import (
    HEADER,
    MAGIC,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Op,
    ProtocolError,
    encode_frame,
)
from banaserve.kvstore.transport.base import KvStoreError, parse_url
from banaserve.kvstore.transport.tcp import TcpTransport

CAPACITY_GB = 0.25
#: What the server's resident memory must stay under, in multiples of its RAM capacity.
RSS_LIMIT_FACTOR = 1.5
START_TIMEOUT_S = 30.0
#: The longest any pattern waits for the server to reach the state it waits for.
PATTERN_TIMEOUT_S = 60.0
PACKAGE_PARENT = Path(banaserve.__file__).resolve().parents[1]


class StoreProcess:
    """``python -m banaserve.kvstore.server`` on ``port`` (0: a free one) in its own session
    (the package imported from where this module was), stopped by its PID. ``token`` goes in
    the environment."""

    def __init__(
        self,
        log_dir: Path,
        *args: str,
        token: str | None = None,
        capacity_gb: float = CAPACITY_GB,
        env: dict[str, str] | None = None,
        port: int = 0,
    ) -> None:
        self.token = token
        self.output = ""  # what it printed after its first line, once stopped
        self.capacity_bytes = int(capacity_gb * (1 << 30))
        argv = [*server_argv(capacity_gb, port), *args]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"store-{time.monotonic_ns()}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=server_env(token, env),
                text=True,
                start_new_session=True,
            )
        self.pid = self.proc.pid
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        self.first_line = self.proc.stdout.readline() if ready else ""
        match = re.search(r"listening on (tcp://[^\s,;]+)", self.first_line)
        if not match:
            self.kill()
            raise RuntimeError(f"store did not start; log: {self.log_path.read_text()}")
        self.url = match.group(1)
        address = parse_url(self.url)
        self.host, self.port = address.host, address.port

    @property
    def shm_url(self) -> str:
        return self.url.replace("tcp://", "shm://")

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM, wait; the exit code."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.output, _ = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)


def server_argv(capacity_gb: float = CAPACITY_GB, port: int = 0) -> list[str]:
    return [sys.executable, "-m", "banaserve.kvstore.server", "--port", str(port),
            "--capacity-gb", str(capacity_gb), "--log-level", "info"]  # fmt: skip


def server_env(token: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a store started here: no inherited tokens, this package first."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TENANT_TOKENS_ENV)}
    path = [env.get(SERVER_PATH_ENV) or str(PACKAGE_PARENT), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    if token is not None:
        env[TOKEN_ENV] = token
    return {**env, **(extra or {})}


def refused_start(*args: str, token: str | None = None) -> tuple[int | None, str]:
    """Run a store that should refuse to start: (exit code, stderr), or (None, ...) if it
    started after all (it is then stopped)."""
    proc = subprocess.Popen(
        [*server_argv(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=server_env(token),
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=START_TIMEOUT_S)
        return proc.returncode, err
    except subprocess.TimeoutExpired:  # it listens: stop it, and say so
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        return None, err


# -- memory and sockets as the kernel sees them -----------------------------------------------


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    raise KeyError(field)


def rss(pid: int) -> int:
    """Resident bytes of ``pid`` now (VmRSS)."""
    return _status_kib(pid, "VmRSS")


def peak_rss(pid: int) -> int:
    """Most resident bytes of ``pid`` since :func:`reset_peak_rss` (VmHWM)."""
    return _status_kib(pid, "VmHWM")


def reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket of ``pid`` in LISTEN state."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with_target = os.readlink(fd) if fd.is_symlink() else ""
        if with_target.startswith("socket:["):
            inodes.add(with_target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            parts = line.split()
            local, state, inode = parts[1], parts[3], parts[9]
            if state != "0A" or inode not in inodes:
                continue
            hex_ip, hex_port = local.split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints each 32-bit word in host (little endian) order.
            ip = b"".join(raw[i : i + 4][::-1] for i in range(0, width // 2, 4))
            family = socket.AF_INET if width == 8 else socket.AF_INET6
            found.append((socket.inet_ntop(family, ip), int(hex_port, 16)))
    return found


# -- talking to the server --------------------------------------------------------------------


class Monitor:
    """One authenticated connection held open for STATS: inside the connection cap, so the
    server can be watched while strangers fill the rest."""

    def __init__(self, url: str, token: str | None) -> None:
        self._transport = TcpTransport(parse_url(url), 10.0)
        self._transport.connect(token)

    def stats(self) -> dict[str, Any]:
        return self._transport.request(Op.STATS, {})["server"]

    def wait_until(
        self, done: Callable[[dict[str, Any]], bool], what: str, timeout: float = PATTERN_TIMEOUT_S
    ) -> dict[str, Any]:
        """Poll STATS until ``done(stats)``; TimeoutError naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if done(stats):
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"server never reached: {what} (last stats {stats})")
            time.sleep(0.01)

    def close(self) -> None:
        self._transport.close()


def header(op: int, control_len: int, payload_len: int, request_id: int = 2) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, op, request_id, control_len, payload_len)


def next_frame(sock: socket.socket, decoder: FrameDecoder) -> Frame:
    """The next frame the server sends on blocking ``sock`` (ConnectionError if it closes)."""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection during HELLO/AUTH")
        frames = decoder.feed(chunk)
        if frames:
            return frames[0]


def handshake(sock: socket.socket, token: str | None) -> list[Frame]:
    """HELLO and AUTH with ``token`` on blocking ``sock``, as a client does; the server's
    replies (an ERROR reply to AUTH ends it)."""
    decoder = FrameDecoder(replies=True)
    nonce = os.urandom(NONCE_BYTES)
    sock.sendall(encode_frame(Op.HELLO, 1, {"version": PROTOCOL_VERSION, "nonce": nonce}))
    replies = [next_frame(sock, decoder)]
    if replies[0].op is Op.ERROR:
        return replies
    proof = None if token is None else client_proof(token, nonce, replies[0].control["nonce"])
    sock.sendall(encode_frame(Op.AUTH, 1, {"proof": proof}))
    return [*replies, next_frame(sock, decoder)]


def connect(host: str, port: int, token: str | None = None) -> socket.socket:
    """A raw connection, authenticated by HELLO and AUTH if ``token`` is given."""
    sock = socket.create_connection((host, port), timeout=10)
    if token is not None:
        replies = handshake(sock, token)
        if replies[-1].op is not Op.AUTH:
            raise KvStoreError(f"AUTH refused: {replies[-1].control}")
    sock.setblocking(False)
    return sock


class Peer:
    """A raw, non-blocking connection that pushes ``data`` and watches for the server's
    ERROR (or its close)."""

    def __init__(self, sock: socket.socket, data: bytes) -> None:
        self.sock = sock
        self.data = memoryview(data)
        self.sent = 0
        self.error: dict[str, Any] | None = None
        self.closed = False
        self._decoder = FrameDecoder(replies=True)

    @property
    def done_sending(self) -> bool:
        return self.sent >= len(self.data) or self.error is not None or self.closed

    def pump(self, readable: bool, writable: bool) -> None:
        if readable and not self.closed:
            try:
                chunk = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                chunk = None
            except OSError:
                chunk = b""
            if chunk == b"":
                self.closed = True
            elif chunk:
                try:
                    for frame in self._decoder.feed(chunk):
                        if frame.op is Op.ERROR:
                            self.error = frame.control
                except ProtocolError:
                    self.closed = True
        if writable and not self.done_sending:
            try:
                self.sent += self.sock.send(self.data[self.sent : self.sent + (1 << 20)])
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self.closed = True

    def close(self) -> None:
        self.sock.close()


def pump_until(peers: list[Peer], done: Callable[[], bool], timeout: float) -> bool:
    """Drive every peer's I/O until ``done()``; False if ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        live = [p for p in peers if not p.closed]
        if not live:
            return done()
        socks = [p.sock for p in live]
        wants = [p.sock for p in live if not p.done_sending]
        readable, writable, _ = select.select(socks, wants, [], min(left, 0.05))
        r, w = set(readable), set(writable)
        for peer in live:
            peer.pump(peer.sock in r, peer.sock in w)
    return True


def close_all(peers: Iterable[Peer]) -> None:
    for peer in peers:
        peer.close()


def put_head(keys: list[bytes], sizes: list[int]) -> bytes:
    """The header and control map of a PUT of ``sizes`` bytes under ``keys``; payload to follow."""
    body = msgpack.packb({"keys": keys, "sizes": sizes}, use_bin_type=True)
    return header(Op.PUT, len(body), sum(sizes)) + body


def key(tag: str) -> bytes:
    return hashlib.sha256(tag.encode()).digest()


def local_address() -> str | None:
    """A non-loopback IPv4 address of this host, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # routing only: a UDP connect sends nothing
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(address).is_loopback else address
