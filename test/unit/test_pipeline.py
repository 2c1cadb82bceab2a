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
    """The fetch of layer i+1 and the store of layer i-1 run while layer i computes: compute
    holds layer 1 until the pipeline's own timestamps show both copies under way, which a
    pipeline that ran its stages one after another would never do."""
    n, size = 6, 1 << 12
    host = random_layers(np.random.default_rng(3), n, size)
    p, dev, out = ring_pipeline(host, 3)
    with p:
        for i in p.layers():
            if i == 1:
                deadline = time.monotonic() + 10
                # Layer 2's fetch begins and layer 0's store ends while layer 1 computes.
                while not (p.timestamps()[2, FETCH, START] >= 0
                           and p.timestamps()[0, STORE, END] >= 0):  # fmt: skip
                    assert time.monotonic() < deadline, "no copy ran during compute"
                    time.sleep(1e-3)
    ts = p.timestamps()
    assert ts[2, FETCH, START] < ts[1, COMPUTE, END]
    assert ts[0, STORE, END] < ts[1, COMPUTE, END]


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


# --- gated fetch (source_ready / source_failed) ------------------------------------------------


def gated_ring(n: int, size: int, depth: int) -> tuple[LayerPipeline, list, list, list]:
    """Gated ring pipeline whose host sources start as zeros: the reader thread fills them."""
    host = [np.zeros(size, np.float32) for _ in range(n)]
    p, dev, out = ring_pipeline(host, depth, gated=True)
    return p, host, dev, out


def test_gated_fetch_waits_for_source_ready() -> None:
    n, size, depth = 8, 4096, 3
    ref = random_layers(np.random.default_rng(21), n, size)
    p, host, dev, out = gated_ring(n, size, depth)
    assert p.gated
    ready_ns = [-1] * n
    first_computed = threading.Event()
    waited = []

    def reader() -> None:  # models the KV-store reader: bytes land, then source_ready
        for i in range(n):
            if i == n - 1:  # the last layer arrives only once layer 0 has been computed
                waited.append(first_computed.wait(30))
            time.sleep(1e-3)  # a fetch that ignored the gate would copy zeros meanwhile
            host[i][:] = ref[i]
            ready_ns[i] = _C.steady_clock_ns()
            assert p.source_ready(i)

    t = threading.Thread(target=reader)
    t.start()
    try:
        with p:
            for i in p.layers():
                # A fetch that ran before its source was ready would have copied zeros.
                np.testing.assert_array_equal(dev[i % depth], ref[i])
                dev[i % depth] += 1.0
                first_computed.set()
    finally:
        first_computed.set()
        t.join()
    ts = p.timestamps()
    check_order(ts, depth)
    for i in range(n):
        assert ts[i, FETCH, START] >= ready_ns[i], f"layer {i} fetched before source_ready"
        np.testing.assert_array_equal(out[i], ref[i] + np.float32(1.0))
    # Layer-wise: compute did not wait for the whole source (the reader held the last layer
    # back until layer 0 was computed; a pipeline waiting for every layer would have hung).
    assert waited == [True]
    assert ts[0, COMPUTE, START] < ready_ns[-1]


def test_source_failed_reaches_caller() -> None:
    n, size = 6, 256
    ref = random_layers(np.random.default_rng(22), n, size)
    p, host, dev, out = gated_ring(n, size, 3)
    computed = []
    third_computed = threading.Event()

    def reader() -> None:
        for i in range(3):
            host[i][:] = ref[i]
            p.source_ready(i)
        # Fail layer 3 once layer 2 is computed: the main thread is then on its way to (or
        # blocked in) wait_fetched(3), which must raise either way.
        assert third_computed.wait(30)
        assert p.source_failed(3, "store read timed out")

    t = threading.Thread(target=reader)
    t.start()
    try:
        with pytest.raises(RuntimeError, match="source of layer 3 failed: store read timed out"):
            with p:
                for i in p.layers():
                    computed.append(i)
                    if i == 2:
                        third_computed.set()
    finally:
        third_computed.set()
        t.join()
    assert computed == [0, 1, 2]
    assert not p.source_ready(3)  # after the failure (and close): ignored
    assert not p.source_failed(4, "late")
    p.close()  # already reported: quiet


def test_source_failed_reported_at_close() -> None:
    p, host, dev, out = gated_ring(3, 64, 2)
    p.source_ready(0)
    p.wait_fetched(0)
    p.computed(0)
    assert p.source_failed(1, "gone")
    with pytest.raises(RuntimeError, match="source of layer 1 failed: gone"):
        p.close()
    p.close()


def test_gated_misuse_and_shutdown() -> None:
    p, host, dev, out = gated_ring(3, 64, 2)
    with pytest.raises(ValueError, match="expected layer 0"):
        p.source_ready(1)
    assert p.source_ready(0)
    with pytest.raises(ValueError, match="expected layer 1"):
        p.source_ready(0)
    with pytest.raises(ValueError, match="out of range"):
        p.source_failed(3, "x")
    p.close()  # the fetch thread, blocked on layer 1's gate, is woken and joined
    assert live_threads() == 0
    assert not p.source_ready(1)  # after close: ignored, no error
    assert not p.source_failed(1, "x")
    with LayerPipeline(1) as q:  # not gated
        assert not q.gated
        with pytest.raises(ValueError, match="not gated"):
            q.source_ready(0)
        with pytest.raises(ValueError, match="not gated"):
            q.source_failed(0, "x")
        for _ in q.layers():
            pass


# --- segment lists ----------------------------------------------------------------------------


def scatter(rng: np.random.Generator, total: int, pieces: int) -> list[tuple[int, int, int]]:
    """Split [0, total) into `pieces` runs (odd sizes, one empty) and give each a place in a pool
    of 2 * total bytes, in shuffled order with gaps: (host offset, pool offset, nbytes)."""
    cuts = np.sort(rng.choice(np.arange(1, total), pieces - 2, replace=False))
    bounds = [0, *cuts.tolist(), cuts[-1], total]  # the repeated cut makes one empty segment
    runs = [(a, b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    order = rng.permutation(len(runs))
    out, pool_off = [None] * len(runs), 0
    for k in order:
        a, n = runs[k]
        pool_off += int(rng.integers(1, 8))  # gap: pages are not adjacent
        out[k] = (int(a), pool_off, int(n))
        pool_off += n
    assert pool_off <= 2 * total
    return out


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("depth", [1, 3])
def test_segment_lists_round_trip(depth: int) -> None:
    n, total = 7, 1237
    rng = np.random.default_rng(100 + depth)
    host = [rng.integers(1, 256, total, dtype=np.uint8) for _ in range(n)]
    pools = [np.zeros(2 * total, np.uint8) for _ in range(depth)]  # scattered "device" pages
    out = [np.zeros(total, np.uint8) for _ in range(n)]
    layouts = [scatter(rng, total, 5) for _ in range(n)]
    # Fetch as buffer pairs, store as raw triples: both entry forms in one pipeline.
    fetch = [
        [(host[i][a : a + m], pools[i % depth][o : o + m]) for a, o, m in layouts[i]]
        for i in range(n)
    ]
    store = [
        [(addr(pools[i % depth]) + o, addr(out[i]) + a, m) for a, o, m in layouts[i]]
        for i in range(n)
    ]
    with LayerPipeline(n, fetch=fetch, store=store, depth=depth) as p:
        for i in p.layers():
            pool = pools[i % depth]
            gathered = np.concatenate([pool[o : o + m] for _, o, m in layouts[i]])
            np.testing.assert_array_equal(gathered, host[i])
            for _, o, m in layouts[i]:
                pool[o : o + m] ^= 0x5A
    for i in range(n):
        np.testing.assert_array_equal(out[i], host[i] ^ 0x5A)


def test_segment_validation() -> None:
    a, b = np.ones(8, np.uint8), np.zeros(8, np.uint8)
    with pytest.raises(ValueError, match=r"fetch\[0\]\[1\]: source has 3 bytes, destination 4"):
        LayerPipeline(1, fetch=[[(a[:4], b[:4]), (a[4:7], b[4:])]])
    with pytest.raises(ValueError, match=r"store\[0\]\[0\]: null address"):
        LayerPipeline(1, store=[[(0, addr(b), 8)]])
    with pytest.raises(ValueError, match="negative"):
        LayerPipeline(1, store=[[(addr(a), addr(b), -1)]])
    with pytest.raises(TypeError, match=r"fetch\[0\]\[0\]"):
        LayerPipeline(1, fetch=[[a]])
    with pytest.raises(ValueError, match="pairs for"):
        LayerPipeline(2, fetch=[[(a, b)]])
    # An empty segment list is "nothing to copy" for that layer.
    with LayerPipeline(2, fetch=[[], [(a, b)]]) as p:
        for _ in p.layers():
            pass
    np.testing.assert_array_equal(b, a)


@pytest.mark.skipif(_C.cuda_device_count() == 0, reason="needs a CUDA device")
def test_cuda_segments_gated_round_trip() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    n, depth, total = 6, 3, 100_003
    rng = np.random.default_rng(12)
    host = [rng.integers(1, 256, total, dtype=np.uint8) for _ in range(n)]
    pools = [torch.zeros(2 * total, dtype=torch.uint8, device="cuda") for _ in range(depth)]
    out = [np.zeros(total, np.uint8) for _ in range(n)]
    layouts = [scatter(rng, total, 9) for _ in range(n)]
    fetch = [
        [(host[i][a : a + m], pools[i % depth][o : o + m]) for a, o, m in layouts[i]]
        for i in range(n)
    ]
    store = [
        [(pools[i % depth][o : o + m], out[i][a : a + m]) for a, o, m in layouts[i]]
        for i in range(n)
    ]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        p = LayerPipeline(
            n,
            fetch=fetch,
            store=store,
            depth=depth,
            device="cuda:0",
            stream=stream.cuda_stream,
            gated=True,
        )
        with p:
            for i in range(n):
                p.source_ready(i)
            for i in p.layers():
                for _, o, m in layouts[i]:
                    pools[i % depth][o : o + m].bitwise_xor_(0x5A)
    for i in range(n):
        np.testing.assert_array_equal(out[i], host[i] ^ 0x5A)
