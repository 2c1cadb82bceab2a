"""The layer-wise handoff: a 2 prefill + 1 decode cluster with ``--kv-store-mode linker``.

Each prefill instance writes a prompt's KV back layer by layer during its forward; the decode
instance it hands off to loads the pages layer by layer, and finds every one of them even
though it looks them up as soon as the prefill has answered (its lookup waits for the pages
the prefill instance claimed). Greedy output equals that of one plain SGLang instance.
Long direct requests also use the prefill cores when they are spare (the default).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from support.cluster import (
    GREEDY,
    Cluster,
    check_a_burst_computes_a_shared_prefix_once,
    generate,
    long_prompt,
    running_cluster,
)
from support.servers import STATE_TIMEOUT, Server

PAGE = 16
#: The request that holds decode-0 in the spare-prefill test: the context is raised past the
#: tiny model's 2,048 so that it cannot end while the test looks (about 15 s at 1,000 tokens/s).
HOLD_TOKENS = 15000


@pytest.fixture(scope="module")
def linker_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("cluster-linker")
    # Every long prompt goes through the handoff this module tests, never spilled around it.
    mode = ("--kv-store-mode", "linker", "--page-size", str(PAGE), "--spill-prefill", "off")
    context = ("--context-length", str(HOLD_TOKENS + 1024))
    env = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    with running_cluster(tiny_model, log_dir, *mode, *context, env=env) as running:
        yield running


def restored_tokens(result: dict) -> int:
    """Prompt tokens the decode instance loaded from the store (SGLang 0.5.23 reports a linker
    hit as ``host``: see test_kvstore_linker.linker_tokens)."""
    details = result["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("host") or 0) + int(details.get("storage") or 0)


def test_every_handoff_loads_the_prefill_pages_layer_wise(
    linker_cluster: Cluster, server: Server
) -> None:
    prompts = [long_prompt(seed=300 + i) for i in range(4)]
    long_enough = {**GREEDY, "max_new_tokens": 24}  # more than --in-place-max-new-tokens
    handoffs = linker_cluster.state()["gateway"]["handoffs"]
    results = []
    for prompt in prompts:
        # One at a time, each to an idle cluster: a long request's first choice is decode-0,
        # so it is handed off (while decode-0 decodes, one would run whole on prefill-1).
        linker_cluster.wait_idle()
        results.append(generate(linker_cluster.url, prompt, sampling_params=long_enough))
    assert linker_cluster.state()["gateway"]["handoffs"] == handoffs + len(prompts)
    for prompt, got in zip(prompts, results, strict=True):
        expected = generate(server.url, prompt, sampling_params=long_enough)
        assert got["output_ids"] == expected["output_ids"]
        # The decode instance computed at most the prompt's last (partial) page.
        full_pages = got["meta_info"]["prompt_tokens"] // PAGE
        assert restored_tokens(got) >= PAGE * (full_pages - 1) > 0, got["meta_info"]

    logs = {name: (linker_cluster.log_dir / f"{name}.log").read_text(errors="replace")
            for name in ("prefill-0", "prefill-1", "decode-0")}  # fmt: skip
    stores = [
        tuple(map(int, m))
        for name in ("prefill-0", "prefill-1")
        for m in re.findall(
            r"layer-wise store: forward \d+, (\d+) pages, (\d+)/(\d+) layers stored during",
            logs[name],
        )
    ]
    assert stores, "no prefill instance logged a layer-wise store"
    assert all(during >= layers - 1 for _, during, layers in stores), stores
    loads = re.findall(
        r"linker load \d+: (\d+) pages, (\d+)/(\d+) layers waited by the forward, ok",
        logs["decode-0"],
    )
    assert len(loads) >= 1 and all(int(w) == int(n) for _, w, n in loads), loads
    assert not re.search(r"linker load \d+ failed", logs["decode-0"])


def test_a_burst_computes_a_shared_prefix_once(linker_cluster: Cluster) -> None:
    # Found 2026-12-01: in linker mode, a request batched with the one loading the prefix may
    # get only part of it (928 of 1175 tokens) and compute a few pages again; the total stays
    # within the bound of one prefix plus two pages per request and instance.
    check_a_burst_computes_a_shared_prefix_once(linker_cluster, seed=303, every_request_hits=False)


def test_a_long_request_runs_on_the_spare_prefill_core(
    linker_cluster: Cluster, server: Server
) -> None:
    """A long request sent while another decodes on decode-0 runs on the other core, a
    prefill instance's, with one plain instance's output."""
    prompt = long_prompt(seed=310, words=300)
    generate(linker_cluster.url, prompt, sampling_params={**GREEDY, "max_new_tokens": 1})
    # Until decode-0's report shows that request gone: a lagging one ranks its core behind
    # prefill-1's, and the held request would go there.
    linker_cluster.wait_idle()
    before = linker_cluster.state()["gateway"]["long_on_prefill"]
    # Far past what this test waits for (the context is raised for it): it runs until this
    # test closes its stream, which aborts it, so "still decoding" is a state, not a pace.
    holding = {**GREEDY, "max_new_tokens": HOLD_TOKENS, "ignore_eos": True}
    streaming, done = threading.Event(), threading.Event()

    def hold() -> None:
        # Read on: a client that stops reading is one that left, and its request is aborted.
        body = {"text": f"{prompt} a", "sampling_params": holding, "stream": True}
        with requests.post(f"{linker_cluster.url}/generate", json=body, stream=True,
                           timeout=STATE_TIMEOUT) as held:  # fmt: skip
            for _ in held.iter_lines():
                streaming.set()
                if done.is_set():
                    return

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert streaming.wait(STATE_TIMEOUT), "the held request never streamed"
        # Both cores were idle: it went to the decode instance, roles' first choice.
        assert linker_cluster.instance("decode-0")["inflight"] == 1
        assert linker_cluster.state()["gateway"]["long_on_prefill"] == before
        long_enough = {**GREEDY, "max_new_tokens": 24}  # more than --in-place-max-new-tokens
        second = generate(linker_cluster.url, f"{prompt} b", sampling_params=long_enough)
        assert linker_cluster.instance("decode-0")["inflight"] == 1, "the held request ended"
    finally:
        done.set()
        holder.join(STATE_TIMEOUT)
    # decode-0's core held one request, prefill-1's none: the second went there.
    assert linker_cluster.state()["gateway"]["long_on_prefill"] == before + 1
    plain = generate(server.url, f"{prompt} b", sampling_params=long_enough)
    assert second["output_ids"] == plain["output_ids"]
    # Closing the stream aborted the held request: nothing is left decoding for later tests.
    deadline = time.monotonic() + STATE_TIMEOUT
    while linker_cluster.instance("decode-0")["inflight"]:
        assert time.monotonic() < deadline, "the held request was not aborted"
        time.sleep(0.5)
