"""Store shard processes and SGLang instances on them, for the end-to-end store tests."""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from banaserve.kvstore.client import KvStoreClient
from banaserve.utils.processes import ManagedProcess, free_port
from support.servers import Server, start_server

TOKEN = "test-token-" + "x" * 8
MAX_TOKENS = 8


def start_shard(logs: Path, name: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [sys.executable, "-m", "banaserve.kvstore.server", "--port", str(port),
            "--capacity-gb", "0.5", "--token", TOKEN]  # fmt: skip
    process = ManagedProcess(name, argv, logs / f"{name}.log")
    process.wait_tcp_open("127.0.0.1", port, 60)
    return process, f"tcp://127.0.0.1:{port}"


def running_shard(logs: Path, name: str = "shard") -> Iterator[str]:
    """One shard process for a fixture to ``yield from``: yields its URL, stops it after."""
    process, url = start_shard(logs, name)
    try:
        yield url
    finally:
        process.stop()


def shard_stats(url: str) -> dict[str, Any]:
    """The shard's server counters (claims, waits, pages, ...)."""
    with KvStoreClient(url, token=TOKEN) as client:
        return client.stats()[url]["server"]


def start_instances(model: Path, urls: list[str], logs: Path, *mode_args: str) -> list[Server]:
    """Instances a and b attached to the shards at ``urls``; started, not yet ready."""
    env = dict(os.environ, BANASERVE_KV_STORE_TOKEN=TOKEN)
    store_args = ("--kv-store", ",".join(urls), *mode_args)
    return [
        start_server(model, logs / f"{name}.log", *store_args, env=env, log_level="info")
        for name in ("a", "b")
    ]


def long_prompt(seed: int, words: int = 400) -> str:
    rng = random.Random(seed)
    vocab = ["river", "stone", "light", "quiet", "market", "window", "garden", "paper",
             "engine", "silver", "morning", "forest", "letter", "bridge", "harbour"]  # fmt: skip
    return " ".join(rng.choice(vocab) for _ in range(words))


def generate(server: Server, text: str) -> dict:
    answer = requests.post(
        f"{server.url}/generate",
        json={"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS}},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def wait_for_pages(urls: list[str], at_least: int, timeout: float = 120) -> None:
    """Instances write to the store in the background; wait until the pages are there."""
    deadline = time.monotonic() + timeout
    with KvStoreClient(urls, token=TOKEN) as client:
        while time.monotonic() < deadline:
            stats = client.stats()
            if (
                min((s.get("ram_pages", 0) for s in stats.values() if s.get("up")), default=0)
                >= at_least
            ):
                return
            time.sleep(0.5)
    raise AssertionError(f"fewer than {at_least} pages reached the store: {stats}")
