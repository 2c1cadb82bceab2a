"""Two SGLang instances share one Global KV Cache Store through the BanaServe external linker.

Instance A computes a long prompt and offloads its pages to the store; instance B restores the
shared prefix from the store layer by layer (BanaServeLinker + gated LayerPipeline) and gives
the same greedy output as a plain SGLang server.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from banaserve.utils.processes import ManagedProcess
from conftest import Server
from test_kvstore_sglang import (
    TOKEN,
    generate,
    long_prompt,
    start_instances,
    start_shard,
    wait_for_pages,
)

PAGE = 16


@dataclass
class Pair:
    urls: list[str]
    a: Server
    b: Server
    logs: Path


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("kvstore-linker")
    processes: list[ManagedProcess] = []
    try:
        shard, url = start_shard(logs, "shard")
        processes.append(shard)
        a, b = start_instances(
            tiny_model, [url], logs, "--kv-store-mode", "linker", "--page-size", str(PAGE)
        )
        processes += [a.process, b.process]
        a.wait_ready()
        b.wait_ready()
        yield Pair([url], a, b, logs)
    finally:
        for process in reversed(processes):
            process.stop()


def linker_tokens(result: dict) -> int:
    """Prefix tokens restored by the external linker. SGLang 0.5.23 reports a linker hit as a
    host hit (the tree's ``host_hit_length``), not as ``storage``: without HiCache there is no
    host tier, so on these instances ``host`` counts exactly the tokens loaded from the store."""
    details = result["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("host") or 0) + int(details.get("storage") or 0)


def test_prefix_from_a_is_loaded_layer_wise_on_b(pair: Pair, server: Server) -> None:
    prompt = long_prompt(seed=11)
    first = generate(pair.a, prompt)
    assert linker_tokens(first) == 0
    full_pages = first["meta_info"]["prompt_tokens"] // PAGE
    # A offloads its pages in the background after the insert.
    wait_for_pages(pair.urls, at_least=full_pages - 1)

    follow_up = prompt + " and then the question is"
    on_b = generate(pair.b, follow_up)
    assert linker_tokens(on_b) >= PAGE * (full_pages - 1), on_b["meta_info"]
    assert on_b["output_ids"] == generate(server, follow_up)["output_ids"]
    assert first["output_ids"] == generate(server, prompt)["output_ids"]
    # The second request on B hits its own device cache, not the store.
    again = generate(pair.b, follow_up)
    assert again["output_ids"] == on_b["output_ids"]
    assert requests.get(f"{pair.b.url}/health", timeout=30).status_code == 200
    # The load was layer-wise: the forward itself waited for every layer's fetch.
    log = (pair.logs / "b.log").read_text(errors="replace")
    loads = re.findall(r"BanaServe linker load \d+: (\d+) pages, (\d+)/(\d+) layers waited", log)
    assert loads, "B logged no linker load"
    pages, waited, layers = map(int, loads[0])
    assert pages >= full_pages - 1 and waited == layers > 0, loads


# -- the layer-wise mechanics without SGLang: more layers than staging slots, misses ------------


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    shard, url = start_shard(tmp_path_factory.mktemp("linker-shard"), "shard")
    try:
        yield url
    finally:
        shard.stop()


def bare_linker(client, layers: int, depth: int, rows: int = 64, page: int = 4):  # noqa: ANN001, ANN201
    """A BanaServeLinker on CPU tensors standing in for SGLang's KV pool (no server)."""
    import torch

    from banaserve.kvstore.keys import KvLayout
    from banaserve.sglang_ext.kvstore_linker import BanaServeLayerCounter, BanaServeLinker

    linker = BanaServeLinker.__new__(BanaServeLinker)
    heads, dim = 2, 8
    linker.num_layers, linker.page_size, linker.depth = layers, page, depth
    linker.layout = KvLayout(layers, heads, dim, "float32", page)
    linker.k_buffers = [torch.zeros(rows, heads, dim) for _ in range(layers)]
    linker.v_buffers = [torch.zeros(rows, heads, dim) for _ in range(layers)]
    linker.device = torch.device("cpu")
    linker.pipeline_device = "cpu"
    linker.forward_stream = None
    linker.row_bytes = heads * dim * 4
    linker.half_bytes = linker.row_bytes * page
    linker._namespace_digest = os.urandom(32)
    linker.client = client
    linker.layer_done_counter = BanaServeLayerCounter(layers)
    linker.stats = dict.fromkeys(
        ("lookup_hits", "load_batches", "loaded_pages", "failed_loads", "offloaded_pages"), 0
    )
    return linker


def test_layer_wise_round_trip_reuses_staging_slots(store_url: str) -> None:
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from banaserve.kvstore.client import KvStoreClient
    from banaserve.pipeline.layer_pipeline import live_threads

    layers, page = 7, 4
    with KvStoreClient([store_url], token=TOKEN) as client:
        src = bare_linker(client, layers, depth=2, page=page)
        for buffer in (*src.k_buffers, *src.v_buffers):
            buffer.copy_(torch.randn_like(buffer))
        hashes = [f"page-{i}" for i in range(3)]
        src_rows = [8, 40, 20]  # scattered device pages
        slots = torch.tensor([r + t for r in src_rows for t in range(page)])
        assert src._store(PoolTransfer(name=PoolName.KV, device_indices=slots, keys=hashes))

        dst = bare_linker(client, layers, depth=2, page=page)
        dst._namespace_digest = src._namespace_digest
        dst_rows = [0, 12, 52]
        batch = dst.layer_done_counter.new_batch()
        dst._start_batch(batch, dst._keys(hashes), dst_rows)
        dst.layer_done_counter.set_consumer(batch.index)
        for layer in range(layers):  # what attention does: K and V wait on each layer
            dst.layer_done_counter.wait_until(layer)
            dst.layer_done_counter.wait_until(layer)
            for s_row, d_row in zip(src_rows, dst_rows, strict=True):
                for s_buf, d_buf in (
                    (src.k_buffers, dst.k_buffers),
                    (src.v_buffers, dst.v_buffers),
                ):
                    assert torch.equal(
                        d_buf[layer][d_row : d_row + page], s_buf[layer][s_row : s_row + page]
                    ), (layer, d_row)
        assert batch.next_layer == layers
        assert dst.finish_layer_wise_loading(batch.index)
        assert live_threads() == 0


def test_a_missing_page_fails_the_batch_without_raising_into_the_forward(store_url: str) -> None:
    from banaserve.kvstore.client import KvStoreClient

    layers = 5
    with KvStoreClient([store_url], token=TOKEN) as client:
        linker = bare_linker(client, layers, depth=2)
        batch = linker.layer_done_counter.new_batch()
        linker._start_batch(batch, linker._keys(["never-stored"]), [0])
        linker.layer_done_counter.set_consumer(batch.index)
        for layer in range(layers):
            linker.layer_done_counter.wait_until(layer)  # never raises
        assert not linker.finish_layer_wise_loading(batch.index)
        assert linker.stats["failed_loads"] == 1
        # A batch the forward never waited on is finished (and fails) just the same.
        batch = linker.layer_done_counter.new_batch()
        linker._start_batch(batch, linker._keys(["never-stored-either"]), [4])
        assert not linker.finish_layer_wise_loading(batch.index)
