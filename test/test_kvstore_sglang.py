"""Two SGLang instances share one Global KV Cache Store (two shards, replication 2).

A prefix computed on instance A is a storage hit on instance B, with the same greedy output
as a plain SGLang server without a store; a shard killed mid-run costs nothing but a miss.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from banaserve.kvstore.client import KvStoreClient
from banaserve.utils.processes import ManagedProcess, free_port
from conftest import Server, start_server

TOKEN = "test-token-" + "x" * 8
MAX_TOKENS = 8


@dataclass
class Cluster:
    shards: list[ManagedProcess]
    urls: list[str]
    a: Server
    b: Server


def start_shard(logs: Path, name: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [sys.executable, "-m", "banaserve.kvstore.server", "--port", str(port),
            "--capacity-gb", "0.5", "--token", TOKEN]  # fmt: skip
    process = ManagedProcess(name, argv, logs / f"{name}.log")
    process.wait_tcp_open("127.0.0.1", port, 60)
    return process, f"tcp://127.0.0.1:{port}"


def start_instances(model: Path, urls: list[str], logs: Path, *mode_args: str) -> list[Server]:
    """Instances a and b attached to the shards at ``urls``; started, not yet ready."""
    env = dict(os.environ, BANASERVE_KV_STORE_TOKEN=TOKEN)
    store_args = ("--kv-store", ",".join(urls), *mode_args)
    return [
        start_server(model, logs / f"{name}.log", *store_args, env=env, log_level="info")
        for name in ("a", "b")
    ]


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("kvstore-cluster")
    processes: list[ManagedProcess] = []
    try:
        shards = []
        for i in range(2):
            process, url = start_shard(logs, f"shard{i}")
            processes.append(process)
            shards.append((process, url))
        urls = [url for _, url in shards]
        a, b = start_instances(
            tiny_model, urls, logs, "--kv-store-replication", "2",
            # Wait for storage loads to finish, so the test sees every hit the store can give.
            "--hicache-storage-prefetch-policy", "wait_complete",
        )  # fmt: skip
        processes += [a.process, b.process]
        a.wait_ready()
        b.wait_ready()
        yield Cluster([p for p, _ in shards], urls, a, b)
    finally:
        for process in reversed(processes):
            process.stop()


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


def storage_tokens(result: dict) -> int:
    details = result["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("storage") or 0)


def wait_for_pages(urls: list[str], at_least: int, timeout: float = 60) -> None:
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


def test_prefix_from_a_is_a_storage_hit_on_b(cluster: Cluster, server: Server) -> None:
    prompt = long_prompt(seed=1)
    first = generate(cluster.a, prompt)
    assert storage_tokens(first) == 0
    wait_for_pages(cluster.urls, at_least=(first["meta_info"]["prompt_tokens"] // 16) - 1)

    follow_up = prompt + " and then the question is"
    on_b = generate(cluster.b, follow_up)
    assert storage_tokens(on_b) >= 16 * ((first["meta_info"]["prompt_tokens"] // 16) - 1)
    assert on_b["output_ids"] == generate(server, follow_up)["output_ids"]
    assert first["output_ids"] == generate(server, prompt)["output_ids"]


def test_a_killed_shard_costs_nothing(cluster: Cluster, server: Server) -> None:
    os.kill(cluster.shards[0].pid, signal.SIGKILL)  # no goodbye to the clients
    cluster.shards[0].process.wait(timeout=10)
    prompt = long_prompt(seed=2)
    first = generate(cluster.a, prompt)
    assert first["output_ids"] == generate(server, prompt)["output_ids"]
    wait_for_pages(cluster.urls[1:], at_least=(first["meta_info"]["prompt_tokens"] // 16) - 1)

    follow_up = prompt + " so what happened next"
    on_b = generate(cluster.b, follow_up)
    assert storage_tokens(on_b) > 0  # served by the surviving replica
    assert on_b["output_ids"] == generate(server, follow_up)["output_ids"]


def test_embedded_store_serves_hits_and_stops_with_the_server(
    tiny_model: Path, server: Server, tmp_path: Path
) -> None:
    import psutil

    env = dict(os.environ)
    env.pop("BANASERVE_KV_STORE_TOKEN", None)
    instance = start_server(
        tiny_model, tmp_path / "embedded.log",
        "--kv-store", "embedded", "--kv-store-capacity-gb", "0.25", env=env,
    )  # fmt: skip
    process, url = instance.process, instance.url
    try:
        instance.wait_ready()
        prompt = long_prompt(seed=3)
        first = generate(instance, prompt)
        expected_hit = 16 * ((first["meta_info"]["prompt_tokens"] // 16) - 1)
        # Drop the device and host caches, so a hit can only come from the store; the write
        # to the store is in the background, so give it a few tries.
        for _ in range(20):
            time.sleep(0.5)
            assert requests.post(f"{url}/flush_cache", timeout=30).status_code == 200
            again = generate(instance, prompt)
            if storage_tokens(again) >= expected_hit:
                break
        assert storage_tokens(again) >= expected_hit
        assert again["output_ids"] == first["output_ids"] == generate(server, prompt)["output_ids"]

        children = psutil.Process(process.pid).children(recursive=True)
        assert any("banaserve.kvstore.server" in " ".join(c.cmdline()) for c in children)
        process.process.send_signal(signal.SIGTERM)
        process.process.wait(timeout=60)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running after SIGTERM: {[c.cmdline() for c in alive]}"
    finally:
        process.stop()
