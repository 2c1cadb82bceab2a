"""A ``banaserve.launch_server`` process on the tiny model, and the limits the tests use."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from banaserve.utils.processes import ManagedProcess, free_port

SERVER_START_TIMEOUT = 300.0
#: Small enough that several servers fit beside each other on a CI machine.
TEST_KV_TOKENS = 16384


class Server:
    """A ``banaserve.launch_server`` process: its URL, model and process (the caller stops it)."""

    def __init__(self, process: ManagedProcess, url: str, model_path: Path, name: str) -> None:
        self.process = process
        self.url = url
        self.model_path = model_path
        self.served_model_name = name

    def wait_ready(self) -> None:
        self.process.wait_http_ok(f"{self.url}/health", SERVER_START_TIMEOUT)


def start_server(
    model: Path,
    log_path: Path,
    *extra_args: str,
    env: Mapping[str, str] | None = None,
    log_level: str = "warning",
) -> Server:
    """Start ``launch_server`` on the tiny model on a free port; not waited for (starting
    several at once overlaps their start-ups)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "banaserve.launch_server",
        "--model-path", str(model), "--port", str(port),
        "--max-total-tokens", str(TEST_KV_TOKENS), "--log-level", log_level,
        *extra_args,
    ]  # fmt: skip
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    process = ManagedProcess(log_path.stem, argv, log_path, env=env)
    return Server(process, f"http://127.0.0.1:{port}", model, model.name)
