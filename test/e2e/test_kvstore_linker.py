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
from support.kvstore_shards import (
    TOKEN,
    generate,
    long_prompt,
    running_shard,
    start_instances,
    start_shard,
    wait_for_pages,
)
from support.servers import STATE_TIMEOUT, Server

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
    # A wrote them back layer-wise: each layer's pages left during its forward, and the
    # offload PUT those copies instead of gathering the pages again.
    log = (pair.logs / "a.log").read_text(errors="replace")
    stores = re.findall(
        r"layer-wise store: forward \d+, (\d+) pages, (\d+)/(\d+) layers stored during", log
    )
    assert stores, "A logged no layer-wise store"
    pages, during, layers = map(int, stores[0])
    assert pages >= full_pages - 1 and during >= layers - 1 > 0, stores
    offloads = re.findall(r"linker offload: (\d+) pages stored, (\d+) from the layer-wise", log)
    assert offloads and int(offloads[0][1]) == int(offloads[0][0]) > 0, offloads


# -- the layer-wise mechanics without SGLang: more layers than staging slots, misses ------------


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from running_shard(tmp_path_factory.mktemp("linker-shard"))


def bare_linker(client, layers: int, depth: int, rows: int = 64, page: int = 4,  # noqa: ANN001, ANN201
                model: str | None = None):  # fmt: skip
    """A BanaServeLinker on CPU tensors standing in for SGLang's KV pool (no server); linkers
    given the same ``model`` share a namespace (by default each has its own)."""
    import torch

    from banaserve.sglang_ext.kvstore_linker import BanaServeLinker
    from banaserve.sglang_ext.layer_store import LayerWiseStore
    from banaserve.sglang_ext.linker_kv import device_kv_of
    from banaserve.sglang_ext.store_attachment import RankIdentity, StoreAttachment

    heads, dim = 2, 8
    kv = device_kv_of([torch.zeros(rows, heads, dim) for _ in range(layers)],
                      [torch.zeros(rows, heads, dim) for _ in range(layers)], page)  # fmt: skip
    layer_store = LayerWiseStore(
        kv.k_buffers, kv.v_buffers, page_size=page, row_bytes=kv.row_bytes, device="cpu"
    )
    store = StoreAttachment(client, RankIdentity(model or os.urandom(8).hex()), kv.layout,
                            owner=f"bare-linker-{os.urandom(4).hex()}")  # fmt: skip
    return BanaServeLinker.assembled(kv, store, layer_store=layer_store, depth=depth,
                                     lookup_wait_s=5.0)  # fmt: skip


def test_layer_wise_round_trip_reuses_staging_slots(store_url: str) -> None:
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from banaserve.kvstore.client import KvStoreClient
    from banaserve.pipeline.layer_pipeline import live_threads

    layers, page = 7, 4
    with KvStoreClient([store_url], token=TOKEN) as client:
        model = f"round-trip-{os.urandom(4).hex()}"  # the two linkers share a namespace
        src = bare_linker(client, layers, depth=2, page=page, model=model)
        for buffer in (*src.kv.k_buffers, *src.kv.v_buffers):
            buffer.copy_(torch.randn_like(buffer))
        hashes = [f"page-{i}" for i in range(3)]
        src_rows = [8, 40, 20]  # scattered device pages
        slots = torch.tensor([r + t for r in src_rows for t in range(page)])
        transfer = PoolTransfer(name=PoolName.KV, device_indices=slots, keys=hashes)
        assert src.offloader.store(transfer)

        dst = bare_linker(client, layers, depth=2, page=page, model=model)
        dst_rows = [0, 12, 52]
        batch = dst.layer_done_counter.new_batch()
        dst.loader.start_batch(batch, dst.store.keys(hashes), dst_rows)
        dst.layer_done_counter.set_consumer(batch.index)
        for layer in range(layers):  # what attention does: K and V wait on each layer
            dst.layer_done_counter.wait_until(layer)
            dst.layer_done_counter.wait_until(layer)
            for s_row, d_row in zip(src_rows, dst_rows, strict=True):
                for s_buf, d_buf in (
                    (src.kv.k_buffers, dst.kv.k_buffers),
                    (src.kv.v_buffers, dst.kv.v_buffers),
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
        linker.loader.start_batch(batch, linker.store.keys(["never-stored"]), [0])
        linker.layer_done_counter.set_consumer(batch.index)
        for layer in range(layers):
            linker.layer_done_counter.wait_until(layer)  # never raises
        assert not linker.finish_layer_wise_loading(batch.index)
        assert linker.stats["failed_loads"] == 1
        # A batch the forward never waited on is finished (and fails) just the same.
        batch = linker.layer_done_counter.new_batch()
        linker.loader.start_batch(batch, linker.store.keys(["never-stored-either"]), [4])
        assert not linker.finish_layer_wise_loading(batch.index)


# -- the layer-wise write-back: a forward's pages leave the device layer by layer -----------------


def test_the_offload_puts_the_pages_the_forward_copied(store_url: str) -> None:
    import numpy as np
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from banaserve.kvstore.client import KvStoreClient
    from support.layer_store import Pool, forward

    layers, page = 4, 4
    with KvStoreClient([store_url], token=TOKEN) as client:
        linker = bare_linker(client, layers, depth=2, page=page)
        pool = Pool.__new__(Pool)
        pool.k_buffer, pool.v_buffer = linker.kv.k_buffers, linker.kv.v_buffers
        linker.layer_store.attach(pool)
        forward(pool, range(8, 16), seed=1)
        slots = torch.arange(8, 16)
        captured = linker.layer_store.resolve(slots)
        assert all(c is not None for c in captured)
        keys = [f"lw-page-{os.urandom(4).hex()}-{i}" for i in range(2)]
        transfer = PoolTransfer(PoolName.KV, device_indices=slots, keys=keys)
        assert linker.offloader.store(transfer, captured)
        assert linker.stats["offloaded_from_capture"] == 2
        # What the store holds is what a gather from the device rows gives.
        gathered = linker.offloader.gather(slots)
        back = [np.empty(gathered[0].numel(), dtype=np.uint8) for _ in keys]
        assert all(client.get(linker.store.keys(keys), back))
        for p in range(2):
            assert np.array_equal(back[p], gathered[p].numpy().reshape(-1)), p


def test_a_lookup_waits_for_pages_another_instance_claimed(store_url: str) -> None:
    """The decode side of a handoff may look pages up before the prefill's offload lands: the
    prefill instance's lookup claimed them, so the decode's waits for the PUT.

    Until issue 35 the offload ran on a 0.5 s timer and the waits were told apart by elapsed
    time; now the store's own counter says when the decode's lookup waits (the offload runs only
    then) and that the lookups that must not wait did not, with waits long enough (60 s) that a
    wrong one would stop the test rather than pass unseen."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from banaserve.kvstore.client import KvStoreClient
    from banaserve.sglang_ext import abort_release
    from support.kvstore_claims import Background, wait_until

    layers, page = 3, 4
    hashes = [f"claimed-{os.urandom(4).hex()}-{i}" for i in range(3)]
    lookup = [PoolTransfer(PoolName.KV, keys=hashes)]
    with (
        KvStoreClient([store_url], token=TOKEN) as a_client,
        KvStoreClient([store_url], token=TOKEN) as b_client,
    ):

        def claim_waits() -> int:
            return a_client.stats()[store_url]["server"]["claim_waits"]

        model = f"handoff-{os.urandom(4).hex()}"  # the two linkers share a namespace
        prefill = bare_linker(a_client, layers, depth=2, page=page, model=model)
        decode = bare_linker(b_client, layers, depth=2, page=page, model=model)
        decode.lookup_wait_s = prefill.lookup_wait_s = 60.0
        assert prefill.lookup("r1", lookup) == []  # a miss that claims the three pages
        waits = claim_waits()
        waiting = Background(lambda: decode.lookup("r2", lookup))
        wait_until(lambda: claim_waits() > waits, STATE_TIMEOUT)
        assert not waiting.done(), "the decode's lookup did not wait for the claimed pages"
        slots = torch.arange(0, 3 * page)
        prefill.offloader.store(PoolTransfer(PoolName.KV, device_indices=slots, keys=hashes))
        assert waiting.result(timeout=STATE_TIMEOUT) == [1, 2, 3]
        # Without the wait the same race is a miss (and the decode computes the prompt again).
        other = [f"{key}-again" for key in hashes]
        assert prefill.lookup("r3", [PoolTransfer(PoolName.KV, keys=other)]) == []
        decode.lookup_wait_s = 0.0
        assert decode.lookup("r4", [PoolTransfer(PoolName.KV, keys=other)]) == []
        decode.lookup_wait_s = 60.0
        # An instance never waits for its own claims (the decode's miss claimed `other`).
        mine = [PoolTransfer(PoolName.KV, keys=[f"{key}-mine" for key in hashes])]
        assert prefill.lookup("r5", mine) == []
        waits = claim_waits()
        assert prefill.lookup("r6", mine) == []
        assert claim_waits() == waits
        # A request aborted before computing its pages releases its claims: no one waits.
        abort_release.request_aborted("r6")
        assert decode.lookup("r7", mine) == []
        assert claim_waits() == waits
