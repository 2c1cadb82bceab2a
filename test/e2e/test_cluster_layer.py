"""``--migration layer`` on a real 2P+1D cluster pinned to two cores: the decode instance runs
as two pipeline stages, layers [0, k) of the tiny model on its own core 0 and [k, 2) on
prefill-1's core 1. It starts whole (k = L = 2: stage 1 runs no layer) and answers token for
token like one plain instance (handed-off and direct requests, streaming too), there and after
the admin moved it (``POST /migration``) to k = 1 and back. When a stage dies mid-generation,
its requests end with a clear error, the cluster keeps serving, and the instance comes back
whole on its own core (boundary L, no longer moved). The controller is off here (its
decisions are ``unit/test_layer_loop.py``'s); the layout's unit tests are
``unit/test_layer_lending.py``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from support.cluster import (
    ADMIN,
    Cluster,
    generate,
    long_prompt,
    running_cluster,
    streamed_generate,
    wait_all_running,
)
from support.servers import Server
from support.stages import listening_sockets, not_on_loopback, stage_processes, thread_masks

#: More than --in-place-max-new-tokens (16): served by the decode instance only.
LONG_OUT = {"temperature": 0.0, "max_new_tokens": 24}
#: Long enough that a stage killed after the first token finds the streams mid-generation.
SLOW_OUT = {"temperature": 0.0, "max_new_tokens": 1500, "ignore_eos": True}

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="the layout lends a second core"
)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("migration-layer")
    with running_cluster(tiny_model, logs, "--migration", "layer") as running:
        # Before the controller's first move can be warranted (5 s): the tests move by hand.
        frozen = {"controller": "off", "reset": True}
        answer = requests.post(f"{running.url}/migration", json=frozen, headers=ADMIN, timeout=30)
        assert answer.status_code == 200, answer.text
        yield running


def test_the_split_decode_instance_matches_a_plain_instance(
    cluster: Cluster, server: Server
) -> None:
    prompts = ["The quick brown fox", "A quiet river", long_prompt(seed=707)]
    before = {i["name"]: i["routed"] for i in cluster.state()["instances"]}
    for prompt in prompts:
        expected = generate(server.url, prompt, sampling_params=LONG_OUT)
        got = generate(cluster.url, prompt, sampling_params=LONG_OUT)
        assert len(expected["output_ids"]) == LONG_OUT["max_new_tokens"]
        assert got["output_ids"] == expected["output_ids"], prompt[:40]
        assert streamed_generate(cluster.url, prompt, LONG_OUT) == expected["text"]
    after = {i["name"]: i["routed"] for i in cluster.state()["instances"]}
    # Every serve step ran on the split decode instance (two per prompt).
    assert after["decode-0"] - before["decode-0"] == 2 * len(prompts)


def test_every_listener_binds_loopback(cluster: Cluster) -> None:
    """Gateway, store, instances, their stages and SGLang's processes listen on the host the
    cluster was given (127.0.0.1), torch.distributed's rendezvous included: before issue 31's
    fix each instance's TCPStore listened on every address (``*:PORT``)."""
    listeners = listening_sockets(cluster.process.pid)
    assert len(listeners) >= 4, listeners  # gateway, store and at least one scheduler each
    assert not_on_loopback(listeners) == {}


def test_the_layout_is_reported_and_the_stages_are_pinned(cluster: Cluster) -> None:
    state = requests.get(f"{cluster.url}/migration", timeout=30).json()
    assert (state["mode"], state["boundary"], state["num_layers"]) == ("layer", 2, 2)
    assert state["stage_cores"] == {"decode-0": [[0], [1]]}
    assert state["boundaries"] == {"decode-0": 2} and state["controller"] == "off"
    decode = cluster.instance("decode-0")
    assert decode["cores"] == [0, 1] and "--pp-layer-boundary" in decode["args"]
    assert "--pp-min-boundary" in decode["args"]
    stages = stage_processes(cluster.state()["pids"]["decode-0"])
    assert sorted(stages) == [0, 1]
    for rank, process in stages.items():
        masks = thread_masks(process)
        assert masks == {frozenset({rank})}, (rank, masks)


def test_a_moved_boundary_still_matches_a_plain_instance(cluster: Cluster, server: Server) -> None:
    """The admin moves decode-0's boundary to 1 (layer 1's weights go to stage 1), to L
    (stage 1 runs no layer, holds no weights) and to 1 again; each answers like a plain
    instance."""
    prompt = "A quiet river"
    expected = generate(server.url, prompt, sampling_params=LONG_OUT)["output_ids"]
    for boundary in (1, 2, 1):
        move = {"instance": "decode-0", "boundary": boundary}
        answer = requests.post(f"{cluster.url}/migration", json=move, headers=ADMIN, timeout=30)
        assert answer.status_code == 200, answer.text
        assert generate(cluster.url, prompt, sampling_params=LONG_OUT)["output_ids"] == expected
        state = requests.get(f"{cluster.url}/migration", timeout=30).json()
        assert state["boundaries"] == {"decode-0": boundary}  # as the instance reports it
        assert state["history"][-1]["reason"] == "admin"
    assert state["moves"] >= 3 and state["bytes_moved"] > 0  # 2 -> 1 sent layer 1's weights


def stream_events(url: str, prompt: str, started: threading.Semaphore) -> list[dict]:
    """Every ``data:`` event of a streamed greedy ``/generate`` (``started`` released at the
    first)."""
    body = {"text": prompt, "sampling_params": SLOW_OUT, "stream": True}
    events = []
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as answer:
        assert answer.status_code == 200, answer.text
        for line in answer.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                events.append(json.loads(line[5:]))
                if len(events) == 1:
                    started.release()
    return events


# Last in this module: it leaves decode-0 restarted as one stage.
def test_a_killed_stage_ends_its_requests_clearly_and_the_instance_comes_back_whole(
    cluster: Cluster, server: Server
) -> None:
    prompts = [f"Story number {i}: once upon a time" for i in range(4)]
    stage_1 = stage_processes(cluster.state()["pids"]["decode-0"])[1]
    started = threading.Semaphore(0)
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = [pool.submit(stream_events, cluster.url, p, started) for p in prompts]
        for _ in prompts:  # every stream is generating
            assert started.acquire(timeout=120), "a stream did not start"
        stage_1.kill()  # the stage on the borrowed core 1
        results = [stream.result(timeout=300) for stream in streams]
    for events in results:  # each was cut mid-generation, and says so
        assert "error" in events[-1], events[-1]
        assert "failed mid-stream" in events[-1]["error"]["message"], events[-1]
        assert 1 <= len(events) - 1 < SLOW_OUT["max_new_tokens"]
    # The cluster keeps serving while decode-0 restarts (prefill instances decode meanwhile).
    prompt = "A quiet river"
    expected = generate(server.url, prompt, sampling_params=LONG_OUT)["output_ids"]
    assert generate(cluster.url, prompt, sampling_params=LONG_OUT)["output_ids"] == expected

    wait_all_running(cluster)
    decode = cluster.instance("decode-0")
    assert decode["cores"] == [0] and "--pp-layer-boundary" not in decode["args"]
    assert stage_processes(cluster.state()["pids"]["decode-0"]) == {}  # one stage, not PP
    state = requests.get(f"{cluster.url}/migration", timeout=30).json()
    assert state["boundaries"] == {"decode-0": 2} and state["stage_cores"] == {"decode-0": [[0]]}
    assert state["history"][-1]["reason"].startswith("the instance died")
    refused = requests.post(f"{cluster.url}/migration", headers=ADMIN,
                            json={"instance": "decode-0", "boundary": 1}, timeout=30)  # fmt: skip
    assert refused.status_code == 409 and "does not run as two stages" in refused.text
    before = decode["routed"]
    for prompt in ["The quick brown fox", long_prompt(seed=708)]:
        expected = generate(server.url, prompt, sampling_params=LONG_OUT)["output_ids"]
        assert generate(cluster.url, prompt, sampling_params=LONG_OUT)["output_ids"] == expected
    assert cluster.instance("decode-0")["routed"] > before  # served by decode-0 again
