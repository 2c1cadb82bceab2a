"""``--migration layer`` on a real 2P+1D cluster pinned to two cores: the decode instance runs
as two pipeline stages, layers [0, 1) of the tiny model on its own core 0 and [1, 2) on
prefill-1's core 1, and still answers token for token like one plain instance (handed-off and
direct requests, streaming too). The layout's unit tests are ``unit/test_layer_lending.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from support.cluster import Cluster, generate, long_prompt, running_cluster, streamed_generate
from support.servers import Server
from support.stages import stage_processes, thread_masks

#: More than --in-place-max-new-tokens (16): served by the decode instance only.
LONG_OUT = {"temperature": 0.0, "max_new_tokens": 24}

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="the layout lends a second core"
)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("migration-layer")
    with running_cluster(tiny_model, logs, "--migration", "layer") as running:
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


def test_the_layout_is_reported_and_the_stages_are_pinned(cluster: Cluster) -> None:
    state = requests.get(f"{cluster.url}/migration", timeout=30).json()
    assert (state["mode"], state["boundary"], state["num_layers"]) == ("layer", 1, 2)
    assert state["stage_cores"] == {"decode-0": [[0], [1]]}
    refused = requests.post(f"{cluster.url}/migration", json={"controller": "on"}, timeout=30)
    assert refused.status_code == 409 and "fixed at start" in refused.text
    decode = cluster.instance("decode-0")
    assert decode["cores"] == [0, 1] and "--pp-layer-boundary" in decode["args"]
    stages = stage_processes(cluster.state()["pids"]["decode-0"])
    assert sorted(stages) == [0, 1]
    for rank, process in stages.items():
        masks = thread_masks(process)
        assert masks == {frozenset({rank})}, (rank, masks)
