"""A model with tied word embeddings (as SmolLM2 has) under ``--pp-size 2``: the platform's
``pp_tied_head`` gives the last stage an ``lm_head``, and greedy output is token for token
that of one plain instance (an 8-layer tied tiny model, split 5|3)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests

from banaserve.models import build_tiny_model
from banaserve.models.tiny import TinySpec
from support.servers import Server, start_server

GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "Once upon a time, in a kingdom by the sea, there lived"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """(plain instance, pp=2 instance split at 5) of an 8-layer tied tiny model."""
    spec = TinySpec(num_hidden_layers=8, tie_word_embeddings=True)
    model = build_tiny_model(tmp_path_factory.mktemp("tied") / "tiny-llama-tied", spec=spec)
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is True
    logs = tmp_path_factory.mktemp("pp_tied_logs")
    started = [start_server(model, logs / "plain.log")]
    try:
        started.append(
            start_server(model, logs / "split.log", "--pp-size", "2", "--pp-layer-boundary", "5")
        )
        for server in started:
            server.wait_ready()
        yield started[0], started[1]
    finally:
        for server in started:
            server.process.stop()


def test_a_tied_model_splits_with_the_same_output(servers: tuple[Server, Server]) -> None:
    plain, split = servers
    body = {"text": PROMPTS, "sampling_params": GREEDY}
    expected = requests.post(f"{plain.url}/generate", json=body, timeout=300).json()
    got = requests.post(f"{split.url}/generate", json=body, timeout=300).json()
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
    assert all(len(r["output_ids"]) == GREEDY["max_new_tokens"] for r in got)
