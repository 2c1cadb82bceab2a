"""Attention offload through a real SGLang instance: its long sequences' decode attention runs
on an attention worker, and greedy output equals one plain instance's token for token."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from banaserve.offload.settings import OffloadSettings
from support.cluster import long_prompt
from support.pipeline import generate
from support.servers import Server, start_server

MIN_TOKENS = 64
#: Past the move's length: a 40-token answer fills its part and moves again mid-answer.
HEADROOM = 16
SAMPLING = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def offloading(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("attention-offload") / "offloading.log"
    settings = OffloadSettings(cores=(os.cpu_count() - 1,), pool_mib=64, min_tokens=MIN_TOKENS,
                               headroom_tokens=HEADROOM)  # fmt: skip
    server = start_server(tiny_model, log, "--attention-offload", settings.to_json(),
                          log_level="info")  # fmt: skip
    try:
        server.wait_ready()
        yield server
    finally:
        server.process.stop()


def log_of(server: Server) -> str:
    return server.process.log_path.read_text(errors="replace")


def test_a_batch_of_long_and_short_sequences_decodes_as_one_plain_instance(
    offloading: Server, server: Server
) -> None:
    prompts = [long_prompt(seed=900 + i, words=words) for i, words in enumerate((300, 8, 120))]
    with ThreadPoolExecutor(len(prompts)) as pool:  # one decode batch, long and short rows
        got = list(pool.map(lambda p: generate(offloading.url, SAMPLING, p), prompts))
    for prompt, answer in zip(prompts, got, strict=True):
        assert answer["output_ids"] == generate(server.url, SAMPLING, prompt)["output_ids"]
    log = log_of(offloading)
    assert "attention offload: worker" in log
    # The two long prompts moved, and moved again when their parts filled up.
    assert log.count("attention offload: moving") >= 4, log[-3000:]
    assert "attention offload stopped" not in log
