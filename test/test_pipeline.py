"""banaserve.pipeline.LayerPipeline: data, ordering, bounded ring, errors and shutdown."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from banaserve import _C
from banaserve.pipeline import LayerPipeline, live_threads

FETCH, COMPUTE, STORE = 0, 1, 2
START, END = 0, 1


def random_layers(rng: np.random.Generator, num_layers: int, size: int) -> list[np.ndarray]:
    """Fresh random float32 layers with no zeros, so a missed copy cannot pass for a real one."""
    return [rng.uniform(0.5, 2.0, size).astype(np.float32) for _ in range(num_layers)]


def ring_pipeline(host: list[np.ndarray], depth: int, **kw) -> tuple[LayerPipeline, list, list]:
    """Pipeline whose device side is `depth` buffers in rotation (layer i in buffer i % depth)."""
    n = len(host)
    dev = [np.zeros_like(host[0]) for _ in range(depth)]
    out = [np.zeros_like(host[0]) for _ in range(n)]
    p = LayerPipeline(
        n,
        fetch=[(host[i], dev[i % depth]) for i in range(n)],
        store=[(dev[i % depth], out[i]) for i in range(n)],
        depth=depth,
        **kw,
    )
    return p, dev, out


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Every test must leave no pipeline worker (C++) or Python thread behind."""
    before = threading.active_count()
    yield
    gc.collect()
    assert live_threads() == 0
    assert threading.active_count() == before


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
@pytest.mark.parametrize("size", [1, 4097, 1 << 16])
def test_data_round_trip(depth: int, size: int) -> None:
    rng = np.random.default_rng(depth * 1000 + size)
    host = random_layers(rng, 9, size)
    p, dev, out = ring_pipeline(host, depth)
    seen = []
    with p:
        for i in p.layers():
            buf = dev[i % depth]
            seen.append(np.array_equal(buf, host[i]))  # fetch delivered layer i, not another
            buf *= 3.0
            buf += i
    assert all(seen)
    for i in range(len(host)):
        np.testing.assert_array_equal(out[i], host[i] * np.float32(3.0) + np.float32(i))


def test_fetch_only_and_store_only() -> None:
    rng = np.random.default_rng(1)
    host = random_layers(rng, 5, 333)
    dev = [np.zeros(333, np.float32) for _ in range(5)]
    with LayerPipeline(5, fetch=list(zip(host, dev, strict=True)), depth=2) as p:
        for i in p.layers():
            np.testing.assert_array_equal(dev[i], host[i])
    out = [np.zeros(333, np.float32) for _ in range(5)]
    with LayerPipeline(5, store=list(zip(host, out, strict=True)), depth=2) as p:
        for _ in p.layers():
            pass
    for a, b in zip(host, out, strict=True):
        np.testing.assert_array_equal(a, b)


def test_raw_addresses() -> None:
    src = np.arange(1, 65, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    addr = (src.__array_interface__["data"][0], 64)
    with LayerPipeline(1, fetch=[(addr, dst)]) as p:
        p.wait_fetched(0)
        p.computed(0)
    np.testing.assert_array_equal(src, dst)


def check_order(ts: np.ndarray, depth: int) -> None:
    """The pipeline's contract, read from its own steady_clock stamps."""
    n = ts.shape[0]
    assert (ts >= 0).all(), "every stage of every layer must have run"
    assert (ts[:, :, START] <= ts[:, :, END]).all()
    for i in range(n):
        assert ts[i, FETCH, END] <= ts[i, COMPUTE, START], f"layer {i} computed before fetched"
        assert ts[i, COMPUTE, END] <= ts[i, STORE, START], f"layer {i} stored before computed"
        if i:
            assert ts[i - 1, FETCH, END] <= ts[i, FETCH, START], "fetches out of order"
            assert ts[i - 1, STORE, END] <= ts[i, STORE, START], "stores out of order"
        if i >= depth:
            assert ts[i - depth, STORE, END] <= ts[i, FETCH, START], f"ring overrun at layer {i}"


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_ordering_from_timestamps(depth: int) -> None:
    rng = np.random.default_rng(7)
    host = random_layers(rng, 12, 1 << 14)
    # Throttled copies (~0.5 ms each) and uneven compute make every interleaving likely.
    t0 = _C.steady_clock_ns()
    p, dev, out = ring_pipeline(host, depth, bytes_per_second=(1 << 16) / 0.5e-3)
    with p:
        for i in p.layers():
            time.sleep(rng.uniform(0, 1e-3))
            dev[i % depth] += 1.0
    ts = p.timestamps()
    assert ts.shape == (12, 3, 2) and ts.dtype == np.int64
    assert ts.min() >= t0
    check_order(ts, depth)
    for i in range(12):
        np.testing.assert_array_equal(out[i], host[i] + np.float32(1.0))


def test_stages_overlap() -> None:
    """With fetch, compute and store each ~2 ms, they run side by side, not one after another."""
    n, size = 10, 1 << 16
    rng = np.random.default_rng(3)
    host = random_layers(rng, n, size)
    p, dev, out = ring_pipeline(host, 3, bytes_per_second=size * 4 / 2e-3)
    start = time.perf_counter()
    with p:
        for _ in p.layers():
            time.sleep(2e-3)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.75 * n * 6e-3, f"{elapsed=:.4f} s: stages did not overlap"


def test_ring_bounds_layers_in_flight() -> None:
    """Slow stores must hold back the fetches: never more than `depth` layers in flight."""
    depth, n, size = 2, 10, 1 << 12
    rng = np.random.default_rng(5)
    host = random_layers(rng, n, size)
    # Instant compute, 1 ms copies: unbounded, the fetches would race ahead of the stores.
    p, dev, out = ring_pipeline(host, depth, bytes_per_second=size * 4 / 1e-3)
    with p:
        for i in p.layers():
            dev[i % depth] -= 0.25
    check_order(p.timestamps(), depth)
    assert p.max_in_flight == depth
    for i in range(n):  # a ring overrun would show up as another layer's bytes
        np.testing.assert_array_equal(out[i], host[i] - np.float32(0.25))


@pytest.mark.parametrize("layer", [0, 3, 7])
def test_fetch_error_reaches_caller(layer: int) -> None:
    host = random_layers(np.random.default_rng(0), 8, 64)
    p, dev, out = ring_pipeline(host, 3, _fault=("fetch", layer))
    computed = []
    with pytest.raises(RuntimeError, match=f"fetch of layer {layer} failed: injected fault"):
        with p:
            for i in p.layers():
                computed.append(i)
    assert all(i < layer for i in computed)
    p.close()  # already reported: closing again is quiet


@pytest.mark.parametrize("layer", [0, 4, 7])
def test_store_error_reaches_caller(layer: int) -> None:
    host = random_layers(np.random.default_rng(0), 8, 64)
    p, dev, out = ring_pipeline(host, 3, _fault=("store", layer))
    with pytest.raises(RuntimeError, match=f"store of layer {layer} failed: injected fault"):
        with p:  # layer 7 is the last: only close() can report it
            for _ in p.layers():
                time.sleep(1e-3)
    p.close()


def test_close_reports_unreported_error_once() -> None:
    host = random_layers(np.random.default_rng(0), 2, 64)
    p, dev, out = ring_pipeline(host, 2, _fault=("store", 1))
    for i in range(2):
        p.wait_fetched(i)
        p.computed(i)
    with pytest.raises(RuntimeError, match="store of layer 1"):
        p.close()
    p.close()


def test_compute_error_stops_pipeline() -> None:
    host = random_layers(np.random.default_rng(0), 8, 64)
    p, dev, out = ring_pipeline(host, 3)
    with pytest.raises(ZeroDivisionError):
        with p:
            for i in p.layers():
                if i == 2:
                    1 / 0  # noqa: B018
    assert live_threads() == 0  # joined by __exit__, not by garbage collection
    with pytest.raises(ValueError, match="closed"):
        p.wait_fetched(2)


def test_close_is_idempotent_and_joins_early() -> None:
    host = random_layers(np.random.default_rng(0), 16, 1 << 12)
    p, dev, out = ring_pipeline(host, 3)
    deadline = time.monotonic() + 5
    while live_threads() < 2 and time.monotonic() < deadline:  # threads start asynchronously
        time.sleep(1e-3)
    assert live_threads() == 2
    p.wait_fetched(0)
    p.computed(0)
    p.close()  # drains the store of layer 0, abandons the rest
    assert live_threads() == 0
    np.testing.assert_array_equal(out[0], host[0])
    p.close()
    p.abort()
    p.close()


def test_dropped_pipeline_joins_threads() -> None:
    host = random_layers(np.random.default_rng(0), 4, 64)
    p, dev, out = ring_pipeline(host, 2)
    p.wait_fetched(0)
    del p
    gc.collect()
    assert live_threads() == 0


def test_misuse_is_rejected() -> None:
    host = random_layers(np.random.default_rng(0), 3, 64)
    p, dev, out = ring_pipeline(host, 2)
    with p:
        with pytest.raises(ValueError, match="expected layer 0"):
            p.wait_fetched(1)
        with pytest.raises(ValueError, match="wait_fetched"):
            p.computed(0)
        for _ in p.layers():
            pass
    with pytest.raises(ValueError, match="bytes"):
        LayerPipeline(1, fetch=[(np.ones(4, np.float32), np.zeros(3, np.float32))])
    with pytest.raises(ValueError, match="pairs for"):
        LayerPipeline(2, fetch=[(np.ones(4), np.zeros(4))])
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(4)
        ro.flags.writeable = False
        LayerPipeline(1, fetch=[(np.ones(4), ro)])
    with pytest.raises(ValueError, match="depth"):
        LayerPipeline(1, depth=0)


def test_cuda_unavailable_is_an_error_not_a_crash() -> None:
    if _C.cuda_device_count() > 0:
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError):
        LayerPipeline(1, device="cuda:0")


@pytest.mark.skipif(_C.cuda_device_count() == 0, reason="needs a CUDA device")
def test_cuda_round_trip() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    n, depth, size = 12, 3, 1 << 18
    rng = np.random.default_rng(11)
    host = random_layers(rng, n, size)
    dev = [torch.zeros(size, dtype=torch.float32, device="cuda") for _ in range(depth)]
    out = [np.zeros(size, np.float32) for _ in range(n)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with LayerPipeline(
            n,
            fetch=[(host[i], dev[i % depth]) for i in range(n)],
            store=[(dev[i % depth], out[i]) for i in range(n)],
            depth=depth,
            device="cuda:0",
            stream=stream.cuda_stream,
        ) as p:
            for i in p.layers():
                dev[i % depth].mul_(3.0).add_(i)
    for i in range(n):
        np.testing.assert_allclose(out[i], host[i] * 3.0 + i, rtol=1e-6)
