"""A store shard started by ``launch_server --kv-store embedded`` for its own instances."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from banaserve.env import TOKEN_ENV
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
