"""Shared fixtures: the tiny model and one BanaServe server on it for the whole session.

An SGLang server takes 25-40 s to start here, so every end-to-end test shares one.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from banaserve.utils.processes import ManagedProcess

SERVER_START_TIMEOUT = 300.0
#: Small enough that several servers fit beside each other on a CI machine.
TEST_KV_TOKENS = 16384


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from banaserve.models import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


class Server:
    """A running ``banaserve.launch_server``: its URL, model and process."""

    def __init__(self, process: ManagedProcess, url: str, model_path: Path, name: str) -> None:
        self.process = process
        self.url = url
        self.model_path = model_path
        self.served_model_name = name


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    logs = tmp_path_factory.mktemp("logs")
    argv = [
        sys.executable, "-m", "banaserve.launch_server",
        "--model-path", str(tiny_model),
        "--port", str(port),
        "--max-total-tokens", str(TEST_KV_TOKENS),
        "--log-level", "warning",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = ManagedProcess("banaserve server", argv, logs / "server.log", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_http_ok(f"{url}/health", SERVER_START_TIMEOUT)
        yield Server(process, url, tiny_model, tiny_model.name)
    finally:
        process.stop()
