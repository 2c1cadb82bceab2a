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

from support.pipeline import BOUNDARY, LAYERS, MIN_BOUNDARY, MOVABLE_START, SPLIT_KV_TOKENS
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


@pytest.fixture(scope="session")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 8 layers (untied, like the default one)."""
    from banaserve.models import build_tiny_model
    from banaserve.models.tiny import TinySpec

    spec = TinySpec(num_hidden_layers=LAYERS)
    return build_tiny_model(tmp_path_factory.mktemp("tiny8") / "tiny-llama-8", spec=spec)


@pytest.fixture(scope="session")
def pp_servers(
    deep_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    """``plain`` (pp=1), ``split`` (pp=2 at BOUNDARY) and ``movable`` (pp=2 at
    MOVABLE_START, movable down to MIN_BOUNDARY), started together."""
    logs = tmp_path_factory.mktemp("pp_logs")
    started: dict[str, Server] = {}
    try:
        started["plain"] = start_server(deep_model, logs / "plain.log")
        started["split"] = start_server(
            deep_model, logs / "split.log",
            "--pp-size", "2", "--pp-layer-boundary", str(BOUNDARY),
            "--max-total-tokens", str(SPLIT_KV_TOKENS),  # the last one given counts
            log_level="info",  # for the stages' KV pool sizes
        )  # fmt: skip
        started["movable"] = start_server(
            deep_model, logs / "movable.log",
            "--pp-size", "2", "--pp-layer-boundary", str(MOVABLE_START),
            "--pp-min-boundary", str(MIN_BOUNDARY),
        )  # fmt: skip
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.process.stop()
