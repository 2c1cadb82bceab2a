"""Two SGLang instances share one Global KV Cache Store (two shards, replication 2).

A prefix computed on instance A is a storage hit on instance B, with the same greedy output
as a plain SGLang server without a store; a shard killed mid-run costs nothing but a miss.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from banaserve.utils.processes import ManagedProcess
from support.kvstore_shards import (
    generate,
    long_prompt,
    start_instances,
    start_shard,
    wait_for_pages,
)
from support.servers import STATE_TIMEOUT, Server, start_server


@dataclass
class Cluster:
    shards: list[ManagedProcess]
    urls: list[str]
    a: Server
    b: Server


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


def storage_tokens(result: dict) -> int:
    details = result["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("storage") or 0)


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
        # to the store is in the background, so try until it has landed (20 tries 0.5 s apart
        # until issue 35: a pace, not a state).
        deadline = time.monotonic() + STATE_TIMEOUT
        while True:
            assert requests.post(f"{url}/flush_cache", timeout=30).status_code == 200
            again = generate(instance, prompt)
            if storage_tokens(again) >= expected_hit:
                break
            assert time.monotonic() < deadline, f"no store hit: {again['meta_info']}"
            time.sleep(0.5)
        assert again["output_ids"] == first["output_ids"] == generate(server, prompt)["output_ids"]

        children = psutil.Process(process.pid).children(recursive=True)
        assert any("banaserve.kvstore.server" in " ".join(c.cmdline()) for c in children)
        process.process.send_signal(signal.SIGTERM)
        process.process.wait(timeout=60)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running after SIGTERM: {[c.cmdline() for c in alive]}"
    finally:
        process.stop()
