"""The layer-wise write-back (banaserve.sglang_ext.layer_store) without SGLang or a store.

A stand-in KV pool with SGLang's writer methods; ``forward`` writes each layer's rows through
it as an attention backend does. The captured pages must equal the device rows, leave the
device while later layers compute, and stop being used once anything else writes their rows.
The CUDA cases run where a GPU is (``benchmark/gpu_check.sh``) and skip elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from banaserve.pipeline.layer_pipeline import COMPUTE, STORE, live_threads
from banaserve.sglang_ext.layer_store import LayerWiseStore, whole_pages
from support.layer_store import DIM, HEADS, Layer, Pool, forward

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]  # fmt: skip


def attached(
    layers: int, page: int, device: str = "cpu", rows: int = 64, **kw: int
) -> tuple[Pool, LayerWiseStore]:
    pool = Pool(layers, rows, device)
    stream = int(torch.cuda.current_stream().cuda_stream) if device == "cuda" else None
    store = LayerWiseStore(
        pool.k_buffer, pool.v_buffer, page_size=page, row_bytes=HEADS * DIM * 4,
        device="cuda:0" if device == "cuda" else "cpu", stream=stream, **kw,
    )  # fmt: skip
    store.attach(pool)
    return pool, store


def page_rows(pool: Pool, first_slot: int, page: int) -> torch.Tensor:
    """The store page of device slots ``first_slot..+page``: [layers, K|V, rows, row bytes]."""
    rows = slice(first_slot, first_slot + page)
    pairs = zip(pool.k_buffer, pool.v_buffer, strict=True)
    layers = torch.stack([torch.stack([k[rows].cpu(), v[rows].cpu()]) for k, v in pairs])
    return layers.view(torch.uint8).reshape(len(pool.k_buffer), 2, page, -1)


def test_whole_pages_are_aligned_runs_of_consecutive_slots() -> None:
    loc = np.array([8, 9, 10, 11, 12, 13, 14, 15, 20, 21, 22, 4, 5, 6, 7, 33, 34, 35, 36, 40])
    assert whole_pages(loc, 4).tolist() == [0, 4, 11]
    assert whole_pages(np.array([1, 2, 3, 4]), 4).tolist() == []
    assert whole_pages(np.array([0, 1, 2]), 4).tolist() == []
    assert whole_pages(np.array([0, 1, 3, 2]), 4).tolist() == []
    assert whole_pages(np.array([5, 3]), 1).tolist() == [0, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_a_forward_pages_leave_the_device_layer_by_layer(device: str) -> None:
    layers, page = 6, 4
    pool, store = attached(layers, page, device)
    # Two whole pages (8..15) and a partial one (20..22), as an extend writes them.
    forward(pool, [*range(8, 16), 20, 21, 22], seed=1, compute_s=0.003)
    assert store.stats.captured_forwards == 1 and store.stats.captured_pages == 2
    captured = store.resolve(torch.arange(8, 16))
    for p, first in enumerate((8, 12)):
        assert captured[p] is not None and torch.equal(captured[p], page_rows(pool, first, page))
    if device == "cpu":  # host timestamps of the worker threads' copies
        (capture,) = store._captures.values()
        ts = capture.stamps
        for layer in range(layers):  # a layer leaves only once written, during the forward
            assert ts[layer, STORE, 0] >= ts[layer, COMPUTE, 1], layer
        assert (ts[:-1, STORE, 1] <= ts[-1, COMPUTE, 1]).all(), ts
        assert capture.stored_during_forward == layers - 1
    assert live_threads() == 0

    # A decode step writing into page 2 (slots 8..11) makes its capture stale; page 3 stays.
    forward(pool, [9], seed=2)
    assert [c is None for c in store.resolve(torch.arange(8, 16))] == [True, False]
    # A load into page 3 does too; a page the forward wrote only in part was never captured.
    store.forget_pages([12])
    assert store.resolve(torch.arange(12, 16)) == [None]
    assert store.resolve(torch.arange(20, 24)) == [None]
    # Slots that are not one whole page in order are never resolved.
    forward(pool, range(32, 40), seed=3)
    assert store.resolve(torch.tensor([33, 32, 34, 35])) == [None]


def test_a_forward_cut_short_drops_its_capture() -> None:
    pool, store = attached(5, 4)
    write = store.wrap(lambda *args: None)
    for layer in range(3):  # the forward fails after layer 2; the next one starts over
        write(Layer(layer), torch.arange(0, 8), None, None)
    forward(pool, range(16, 24), seed=3)
    assert store.stats.dropped == 1
    assert store.resolve(torch.arange(0, 8)) == [None, None]
    assert all(c is not None for c in store.resolve(torch.arange(16, 24)))
    # Layers out of order (not one write per layer) drop the capture, never the forward.
    write(Layer(0), torch.arange(0, 8), None, None)
    write(Layer(2), torch.arange(0, 8), None, None)
    assert store._open is None and live_threads() == 0


def test_other_writers_of_the_pool_unmap_the_pages_they_write() -> None:
    pool, store = attached(3, 4)
    forward(pool, range(0, 16), seed=4)
    assert all(c is not None for c in store.resolve(torch.arange(0, 16)))
    pool.move_kv_cache(torch.arange(4, 8), torch.arange(32, 36))
    unmapped = [c is None for c in store.resolve(torch.arange(0, 16))]
    assert unmapped == [False, True, False, False]


def test_captures_stay_within_their_budget() -> None:
    page_bytes = 2 * 2 * 4 * HEADS * DIM * 4  # layers x K|V x rows x row bytes
    pool, store = attached(2, 4, budget_bytes=3 * page_bytes)
    forward(pool, range(0, 16), seed=5)  # 4 pages: over the budget, not captured
    assert store.stats.skipped_over_budget == 1 and store.resolve(torch.arange(0, 4)) == [None]
    forward(pool, range(16, 24), seed=6)  # 2 pages
    forward(pool, range(32, 40), seed=7)  # 2 more: the oldest capture makes room
    assert store.resolve(torch.arange(16, 24)) == [None, None]
    assert all(c is not None for c in store.resolve(torch.arange(32, 40)))
    assert sum(c.nbytes for c in store._captures.values()) <= 3 * page_bytes
    pool, store = attached(2, 4, budget_bytes=0)  # capturing off
    forward(pool, range(0, 16), seed=8)
    assert store.stats.captured_forwards == 0 and store.resolve(torch.arange(0, 4)) == [None]
