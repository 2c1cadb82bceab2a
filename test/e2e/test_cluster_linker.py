"""The layer-wise handoff: a 2 prefill + 1 decode cluster with ``--kv-store-mode linker``.

Each prefill instance writes a prompt's KV back layer by layer during its forward; the decode
instance it hands off to loads the pages layer by layer, and finds every one of them even
though it looks them up as soon as the prefill has answered (its lookup waits for the pages
the prefill instance claimed). Greedy output equals that of one plain SGLang instance.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.cluster import (
    Cluster,
    check_a_burst_computes_a_shared_prefix_once,
    generate,
    long_prompt,
    running_cluster,
)
from support.servers import Server

PAGE = 16


@pytest.fixture(scope="module")
def linker_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("cluster-linker")
    # Every long prompt goes through the handoff this module tests, never spilled around it.
    mode = ("--kv-store-mode", "linker", "--page-size", str(PAGE), "--spill-prefill", "off")
    with running_cluster(tiny_model, log_dir, *mode) as running:
        yield running


def restored_tokens(result: dict) -> int:
    """Prompt tokens the decode instance loaded from the store (SGLang 0.5.23 reports a linker
    hit as ``host``: see test_kvstore_linker.linker_tokens)."""
    details = result["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("host") or 0) + int(details.get("storage") or 0)


def test_every_handoff_loads_the_prefill_pages_layer_wise(
    linker_cluster: Cluster, server: Server
) -> None:
    prompts = [long_prompt(seed=300 + i) for i in range(6)]
    handoffs = linker_cluster.state()["gateway"]["handoffs"]
    with ThreadPoolExecutor(3) as pool:  # concurrent, over both prefill instances
        results = list(pool.map(lambda p: generate(linker_cluster.url, p), prompts))
    assert linker_cluster.state()["gateway"]["handoffs"] == handoffs + len(prompts)
    for prompt, got in zip(prompts, results, strict=True):
        assert got["output_ids"] == generate(server.url, prompt)["output_ids"]
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
