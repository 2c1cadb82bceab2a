"""SGLang's pipeline parallelism on the CPU through BanaServe's launcher: an 8-layer tiny
model split 3|5 (``--pp-size 2 --pp-layer-boundary 3``) answers token for token like one
plain instance of the same model, one request at a time, four in one batch, and streamed.
The same split with a movable boundary (``--pp-min-boundary``: see
``test_pp_movable.py``) shares this module's servers.

The split instance needs the platform's ``pp_cpu`` patch (no pynccl for the pipeline group)
and the launcher's environment (the thread binding and the layer partition); both servers run
one OpenMP thread each (``support.servers``), which bit-exactness needs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from banaserve.config.pipeline_options import threads_bind
from support.pipeline import BOUNDARY, LAYERS, SPLIT_KV_TOKENS, generate, streamed
from support.servers import Server
from support.stages import stage_processes, thread_masks

NEW_TOKENS = 24
#: Every request generates exactly NEW_TOKENS tokens, so whole sequences are compared.
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a kingdom by the sea, there lived",
    "apples, rivers and stars",
    " ".join(f"Sentence number {i} talks about apples, rivers and stars." for i in range(6)),
]


@pytest.fixture(scope="module")
def servers(pp_servers: dict[str, Server]) -> tuple[Server, Server]:
    """(plain pp=1 instance, pp=2 instance split at BOUNDARY)."""
    return pp_servers["plain"], pp_servers["split"]


def test_each_stage_holds_the_layers_it_was_given(
    servers: tuple[Server, Server], deep_model: Path
) -> None:
    """Stage 0 allocates KV for layers [0, 3), stage 1 for [3, 8): SGLang sizes a stage's
    pool from its layer range, so its logged K size counts that stage's layers."""
    _, split = servers
    log = split.process.log_since_start()
    assert "Traceback" not in log, log[-3000:]
    config = json.loads((deep_model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    k_bytes_per_token_layer = config["num_key_value_heads"] * head_dim * 4  # float32
    sizes = {
        stage: (int(tokens), k_gib)
        for stage, tokens, k_gib in re.findall(
            r"PP(\d)\] KV Cache is allocated\. .*#tokens: (\d+), K size: ([\d.]+) GB", log
        )
    }
    assert set(sizes) == {"0", "1"}, log[-3000:]
    for stage, layers in (("0", BOUNDARY), ("1", LAYERS - BOUNDARY)):
        tokens, k_gib = sizes[stage]
        assert tokens >= SPLIT_KV_TOKENS // 2  # the margin the comment above counts on
        assert k_gib == f"{tokens * k_bytes_per_token_layer * layers / 2**30:.2f}", sizes


def test_each_stage_runs_on_its_own_core(servers: tuple[Server, Server]) -> None:
    """SGLang binds a rank's threads only with its AMX kernels; BanaServe's platform pins each
    stage process (every thread) to its entry of SGLANG_CPU_OMP_THREADS_BIND, which the
    launcher split from the server's cores: here stage 0 on one core, stage 1 on the other."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: both stages share it")
    _, split = servers
    stages = stage_processes(split.process.pid)
    assert sorted(stages) == [0, 1], [" ".join(p.cmdline()) for p in stages.values()]
    expected = threads_bind(2, cores).split("|")
    for rank, process in stages.items():
        want = {int(core) for core in expected[rank].split(",")}
        masks = thread_masks(process)
        assert masks == {frozenset(want)}, (rank, masks)


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_one_at_a_time_matches_a_plain_instance(
    servers: tuple[Server, Server], prompt: int
) -> None:
    plain, split = servers
    expected = generate(plain.url, GREEDY, PROMPTS[prompt])
    got = generate(split.url, GREEDY, PROMPTS[prompt])
    assert len(expected["output_ids"]) == NEW_TOKENS
    assert got["output_ids"] == expected["output_ids"]
    assert got["text"] == expected["text"]


def test_a_batch_matches_a_plain_instance(servers: tuple[Server, Server]) -> None:
    plain, split = servers
    expected = generate(plain.url, GREEDY, PROMPTS)
    got = generate(split.url, GREEDY, PROMPTS)
    assert len(got) == len(expected) == len(PROMPTS)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
    assert all(len(r["output_ids"]) == NEW_TOKENS for r in got)


def test_a_stream_matches_a_plain_instance(servers: tuple[Server, Server]) -> None:
    plain, split = servers
    expected = generate(plain.url, GREEDY, PROMPTS[1])
    ids, text, chunks = streamed(split.url, GREEDY, PROMPTS[1])
    assert ids == expected["output_ids"]
    assert text == expected["text"]
    assert chunks > 1
