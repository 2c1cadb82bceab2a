"""Fixtures for the whole suite (unit and end-to-end): the tiny model and one BanaServe server
on it for the whole session.

An SGLang server takes 25-40 s to start here, so every end-to-end test shares one. Both live
here, above ``unit/`` and ``e2e/``, so that one run of both folders builds each only once.
Helpers (``Server``, ``start_server``, ...) are in ``support.servers``, not here: test modules
must not import a ``conftest`` by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.servers import Server, start_server


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from banaserve.models import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_model, tmp_path_factory.mktemp("logs") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.process.stop()
