"""Clients of a real 1P+1D cluster started with ``--api-key``: those with the key are served as
by one SGLang instance, those without are refused, and those that leave stop their work
(issue 31).

Before: the instances got the key and the gateway neither checked nor forwarded it, so every
relayed request was answered 401 while the gateway's own routes stayed open; and a
non-streaming client that gave up left its request generating to the end, for no one.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from support.cluster import ADMIN, ADMIN_TOKEN, Cluster, long_prompt, running_cluster
from support.servers import STATE_TIMEOUT, Server

KEY = "test-key-31"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
#: A request that cannot end while a test looks (the context is raised for it): whether it
#: was aborted is a state, not a pace.
HOLD_TOKENS = 15000
ABORTED = re.compile(r"^sglang:num_aborted_requests_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("cluster-clients")
    # --spill-prefill off: a long prompt to the idle cluster is handed off, not run whole.
    extra = ("--api-key", KEY, "--context-length", str(HOLD_TOKENS + 1024),
             "--spill-prefill", "off")  # fmt: skip
    env = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    with running_cluster(tiny_model, logs, *extra, prefill=1, decode=1, env=env) as running:
        yield running


def call(cluster: Cluster, method: str, path: str, key: str | None, **kwargs: object):  # noqa: ANN201
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.request(method, f"{cluster.url}{path}", headers=headers, timeout=300,
                            **kwargs)  # fmt: skip


def state(cluster: Cluster) -> dict:
    answer = requests.get(f"{cluster.url}/cluster", headers=ADMIN, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_request_without_the_key_is_refused(cluster: Cluster) -> None:
    body = {"text": "Hello", "sampling_params": GREEDY}
    for key in (None, "wrong-key"):
        calls = [("POST", "/generate", {"json": body}), ("GET", "/v1/models", {}),
                 ("GET", "/cluster", {})]  # fmt: skip
        for method, path, extra in calls:
            answer = call(cluster, method, path, key, **extra)
            assert answer.status_code == 401, (key, path, answer.text)
            assert answer.json() == {"error": "Unauthorized"}
    # An admin call needs the admin token, the API key is not enough.
    for key in (None, KEY):
        answer = call(cluster, "POST", "/flush_cache", key)
        assert answer.status_code == 401 and "admin token" in answer.text
    # The API key shows /cluster without what only the operator may see.
    shown = call(cluster, "GET", "/cluster", KEY).json()
    assert "pids" not in shown and "args" not in shown["instances"][0]
    # Probes and scrapers need none, as on one SGLang server.
    assert call(cluster, "GET", "/health", None).status_code == 200
    assert call(cluster, "GET", "/metrics", None).status_code == 200


def test_other_host_names_are_refused(cluster: Cluster) -> None:
    """DNS rebinding (issue 31): before, the gateway served any Host header."""
    port = cluster.url.rsplit(":", 1)[1]
    body = {"text": "Hello", "sampling_params": GREEDY}

    def post(path: str, host: str, headers: dict[str, str]) -> requests.Response:
        return requests.post(f"{cluster.url}{path}", json=body, timeout=300,
                             headers={**headers, "Host": host})  # fmt: skip

    answer = post("/generate", f"evil.example:{port}", AUTH)
    assert answer.status_code == 400 and "evil.example" in answer.json()["message"]
    assert post("/flush_cache", "evil.example", ADMIN).status_code == 400
    served = post("/generate", f"localhost:{port}", AUTH)
    assert served.status_code == 200, served.text


def test_with_the_key_the_cluster_serves_as_one_instance(cluster: Cluster, server: Server) -> None:
    handoffs = state(cluster)["gateway"]["handoffs"]
    # Direct, then a handoff (more output tokens than --in-place-max-new-tokens), sent to an
    # idle cluster, whose first choice for a long request is the decode instance.
    long_out = {**GREEDY, "max_new_tokens": 24}
    for prompt, params in [("The quick brown fox", GREEDY), (long_prompt(seed=731), long_out)]:
        cluster.wait_idle()
        body = {"text": prompt, "sampling_params": params}
        expected = requests.post(f"{server.url}/generate", json=body, timeout=300).json()
        answer = call(cluster, "POST", "/generate", KEY, json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["output_ids"] == expected["output_ids"]
    now = state(cluster)
    assert now["gateway"]["handoffs"] == handoffs + 1
    # The gateway's /v1/loads polls carry the key: every instance is read and in routing.
    for instance in now["instances"]:
        assert instance["load"]["healthy"] and instance["load"]["kv_capacity_tokens"] > 0
        assert instance["failed"] == 0


def aborted(cluster: Cluster) -> float:
    """Requests the instances' tokenizer managers aborted, all instances together."""
    total = 0.0
    for instance in state(cluster)["instances"]:
        metrics = requests.get(f"{instance['url']}/metrics", timeout=30).text
        total += sum(float(v) for v in ABORTED.findall(metrics))
    return total


def send_then_reset(cluster: Cluster, body: dict, when_running: bool) -> None:
    """Send ``body`` to ``/generate`` on a raw socket, wait until an instance runs it (or its
    handoff is in flight), then reset the connection (RST, as a killed client does)."""
    address = urlsplit(cluster.url)
    data = json.dumps(body).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: {address.netloc}\r\n"
            f"Content-Type: application/json\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()  # fmt: skip
    client = socket.create_connection((address.hostname, address.port))
    try:
        client.sendall(head + data)
        deadline = time.monotonic() + STATE_TIMEOUT
        while True:
            instances = state(cluster)["instances"]
            busy = [i for i in instances if i["inflight"]]
            if busy and (not when_running or any(i["load"]["running_reqs"] for i in busy)):
                break
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    finally:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()


def test_a_client_that_leaves_stops_its_request(cluster: Cluster) -> None:
    before = aborted(cluster)
    holding = {"temperature": 0.0, "max_new_tokens": HOLD_TOKENS, "ignore_eos": True}
    send_then_reset(cluster, {"text": "Hello", "sampling_params": holding}, when_running=True)
    cluster.wait_idle()
    assert aborted(cluster) == before + 1  # aborted, not generated to its end for no one


def test_a_stream_reset_early_is_the_clients_failure_not_the_instances(cluster: Cluster) -> None:
    """A streamed request whose client resets while its prompt is handed off: nothing is
    counted against an instance, and the cluster serves the next request at once."""
    errors = state(cluster)["gateway"]["errors"]
    body = {"text": long_prompt(seed=733), "sampling_params": {**GREEDY, "max_new_tokens": 64},
            "stream": True}  # fmt: skip
    send_then_reset(cluster, body, when_running=False)
    instances = cluster.wait_idle()
    assert all(i["failed"] == 0 and i["load"]["healthy"] for i in instances), instances
    assert state(cluster)["gateway"]["errors"] == errors
    answer = call(cluster, "POST", "/generate", KEY,
                  json={"text": "Hello", "sampling_params": GREEDY})  # fmt: skip
    assert answer.status_code == 200, answer.text


def test_a_stuck_instance_leaves_routing_and_its_request_is_served_elsewhere(
    cluster: Cluster, server: Server
) -> None:
    """decode-0's scheduler stopped (SIGSTOP) while its HTTP server still answers load polls:
    a request sent to it is retried on the other instance once decode-0 has held it for
    ``--stall-timeout`` without progress, and decode-0 returns once it moves again."""
    import psutil

    instance = psutil.Process(state(cluster)["pids"]["decode-0"])
    scheduler = next(
        p for p in instance.children(recursive=True) if "scheduler" in " ".join(p.cmdline())
    )
    body = {"text": "A quiet river", "sampling_params": {**GREEDY, "max_new_tokens": 24}}
    expected = requests.post(f"{server.url}/generate", json=body, timeout=300).json()
    scheduler.suspend()
    try:
        answer = call(cluster, "POST", "/generate", KEY, json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["output_ids"] == expected["output_ids"]
        decode = decode_0(cluster)
        assert decode["stalls"] == 1 and not decode["load"]["healthy"]
    finally:
        scheduler.resume()
    deadline = time.monotonic() + STATE_TIMEOUT
    while not decode_0(cluster)["load"]["healthy"]:
        assert time.monotonic() < deadline, "decode-0 never came back after SIGCONT"
        time.sleep(0.5)


def decode_0(cluster: Cluster) -> dict:
    return next(i for i in state(cluster)["instances"] if i["name"] == "decode-0")


def test_server_info_shows_no_key(cluster: Cluster) -> None:
    """SGLang's server info lists every argument, the API key and the admin token included."""
    for path in ("/server_info", "/get_server_info"):
        info = call(cluster, "GET", path, KEY).json()
        assert info["api_key"] == "<redacted>" and info["admin_api_key"] == "<redacted>"
        assert "launch_command" not in info
        assert KEY not in json.dumps(info) and ADMIN_TOKEN not in json.dumps(info)
