"""A store shard started by ``launch_server --kv-store embedded`` for its own instances."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from banaserve.env import TOKEN_ENV
from banaserve.kvstore.protocol import Op, ProtocolError
from banaserve.kvstore.transport import KvStoreError, open_transport, parse_url
from banaserve.utils.processes import ManagedProcess, free_port

START_TIMEOUT = 60.0


def start_embedded_store(
    capacity_gb: float, token: str | None, log_dir: Path, host: str = "127.0.0.1"
) -> tuple[ManagedProcess, str, str]:
    """Start one shard on a free local port; return (process, URL, token).

    The caller owns the process and must ``stop()`` it. Without a token a random one is
    made, so that no other local user can read the pages. Same-host clients use shm://.
    """
    token = token or secrets.token_hex(16)
    port = free_port(host)
    argv = [
        sys.executable, "-m", "banaserve.kvstore.server",
        "--host", host, "--port", str(port), "--capacity-gb", str(capacity_gb),
    ]  # fmt: skip
    env = {**os.environ, TOKEN_ENV: token}
    process = ManagedProcess("embedded KV store", argv, log_dir / "kvstore.log", env=env)
    try:
        process.wait_tcp_open(host, port, START_TIMEOUT)
    except BaseException:
        process.stop()
        raise
    return process, f"shm://{host}:{port}", token


def proves_token(url: str, token: str | None, timeout_s: float = 5.0) -> bool:
    """Whether the store at ``url`` completes a handshake with ``token`` (so holds it) and
    answers STATS: how a restarted shard is known to be back, since a port that merely
    accepts may be another process's. Blocks up to about ``timeout_s``."""
    transport = open_transport(parse_url(url), timeout_s)
    try:
        transport.connect(token)
        transport.request(Op.STATS, {})
        return True
    except (KvStoreError, ProtocolError, OSError):
        return False
    finally:
        transport.close()
