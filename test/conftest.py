"""Shared fixtures: the tiny model and one BanaServe server on it for the whole session.

An SGLang server takes 25-40 s to start here, so every end-to-end test shares one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from banaserve.utils.processes import ManagedProcess, free_port

SERVER_START_TIMEOUT = 300.0
#: Small enough that several servers fit beside each other on a CI machine.
TEST_KV_TOKENS = 16384


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from banaserve.models import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


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


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_model, tmp_path_factory.mktemp("logs") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.process.stop()
