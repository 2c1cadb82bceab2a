"""``--api-key`` on a real 1P+1D cluster: the gateway asks clients for the key as one SGLang
server does and sends it to its instances, so relays, handoffs and load polls all work (issue
31: before, the instances got the key and the gateway neither checked nor forwarded it, so
every relayed request was answered 401 while the gateway's own routes stayed open)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from support.cluster import Cluster, long_prompt, running_cluster
from support.servers import Server

KEY = "test-key-31"
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("cluster-api-key")
    with running_cluster(tiny_model, logs, "--api-key", KEY, prefill=1, decode=1) as running:
        yield running


def call(cluster: Cluster, method: str, path: str, key: str | None, **kwargs: object):  # noqa: ANN201
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.request(method, f"{cluster.url}{path}", headers=headers, timeout=300,
                            **kwargs)  # fmt: skip


def test_a_request_without_the_key_is_refused(cluster: Cluster) -> None:
    body = {"text": "Hello", "sampling_params": GREEDY}
    for key in (None, "wrong-key"):
        for method, path, extra in [("POST", "/generate", {"json": body}),
                                    ("GET", "/v1/models", {}), ("GET", "/cluster", {}),
                                    ("POST", "/flush_cache", {})]:  # fmt: skip
            answer = call(cluster, method, path, key, **extra)
            assert answer.status_code == 401, (key, path, answer.text)
            assert answer.json() == {"error": "Unauthorized"}
    # Probes and scrapers need none, as on one SGLang server.
    assert call(cluster, "GET", "/health", None).status_code == 200
    assert call(cluster, "GET", "/metrics", None).status_code == 200


def test_with_the_key_the_cluster_serves_as_one_instance(cluster: Cluster, server: Server) -> None:
    for prompt in ["The quick brown fox", long_prompt(seed=731)]:  # direct, then a handoff
        body = {"text": prompt, "sampling_params": GREEDY}
        expected = requests.post(f"{server.url}/generate", json=body, timeout=300).json()
        answer = call(cluster, "POST", "/generate", KEY, json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["output_ids"] == expected["output_ids"]
    state = call(cluster, "GET", "/cluster", KEY).json()
    assert state["gateway"]["handoffs"] == 1
    # The gateway's /v1/loads polls carry the key: every instance is read and in routing.
    for instance in state["instances"]:
        assert instance["load"]["healthy"] and instance["load"]["kv_capacity_tokens"] > 0
        assert instance["failed"] == 0
