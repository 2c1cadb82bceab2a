"""Storage tiers of the global KV store: RAM LRU, SSD page files, and the tiered store."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from banaserve.kvstore.storage import MemoryStore, SsdStore, StoreStats, TieredStore
from banaserve.kvstore.storage.pagefile import HEADER_BYTES

PAGE = 1024


def make_key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def make_page(i: int, size: int = PAGE) -> bytes:
    """Random bytes, reproducible per ``i``, never all zero."""
    data = random.Random(i).randbytes(size)
    assert any(data)
    return data


def page_path(directory: Path, key: bytes) -> Path:
    return directory / key.hex()[:2] / f"{key.hex()}.page"


# -- MemoryStore -----------------------------------------------------------------------------


def test_memory_lru_order_and_capacity() -> None:
    store = MemoryStore(3 * PAGE)
    for i in range(3):
        assert store.put(make_key(i), make_page(i))
    assert store.get(make_key(0)) == make_page(0)  # 0 is now most recent; 1 is LRU
    assert store.put(make_key(3), make_page(3))
    assert not store.contains(make_key(1))
    assert [store.contains(make_key(i)) for i in (0, 2, 3)] == [True, True, True]
    st = store.stats()
    assert (st.ram_pages, st.ram_bytes, st.evicted_ram, st.puts) == (3, 3 * PAGE, 1, 4)
    # contains() does not refresh order: 2 is LRU now and goes next.
    assert store.contains(make_key(2))
    store.put(make_key(4), make_page(4))
    assert not store.contains(make_key(2))


def test_memory_replace_and_variable_sizes() -> None:
    store = MemoryStore(4 * PAGE)
    store.put(make_key(0), make_page(0, 3 * PAGE))
    store.put(make_key(0), make_page(1, PAGE))  # replacement frees the old bytes
    assert store.stats().ram_bytes == PAGE
    assert store.get(make_key(0)) == make_page(1, PAGE)
    store.put(make_key(1), make_page(2, 3 * PAGE))
    store.put(make_key(2), make_page(3, 2 * PAGE))  # needs both older pages gone
    st = store.stats()
    assert (st.ram_pages, st.ram_bytes, st.evicted_ram) == (1, 2 * PAGE, 2)


def test_memory_on_evict_called_outside_lock() -> None:
    evicted: list[tuple[bytes, bytes]] = []
    store: MemoryStore

    def on_evict(key: bytes, value: bytes) -> None:
        assert store.stats().ram_pages == 2  # would deadlock if called under the lock
        evicted.append((key, value))

    store = MemoryStore(2 * PAGE, on_evict=on_evict)
    for i in range(4):
        store.put(make_key(i), make_page(i))
    assert evicted == [(make_key(0), make_page(0)), (make_key(1), make_page(1))]


def test_memory_rejects_oversized_value_without_change() -> None:
    evicted: list[bytes] = []
    store = MemoryStore(2 * PAGE, on_evict=lambda k, v: evicted.append(k))
    store.put(make_key(0), make_page(0))
    before = store.stats()
    assert not store.put(make_key(1), make_page(1, 2 * PAGE + 1))
    assert store.stats() == before
    assert not store.contains(make_key(1)) and evicted == []
    assert store.get(make_key(0)) == make_page(0)
    assert store.put(make_key(2), make_page(2, 2 * PAGE))  # exactly the capacity fits


def test_bad_key_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        MemoryStore(PAGE).put(b"short", b"x")
    with pytest.raises(ValueError):
        TieredStore(PAGE).put(b"\x01" * 33, b"x")


# -- SsdStore --------------------------------------------------------------------------------


def test_ssd_round_trip_and_layout(tmp_path: Path) -> None:
    store = SsdStore(tmp_path, 10 * PAGE)
    key, page = make_key(7), make_page(7)
    assert store.put(key, page)
    path = page_path(tmp_path, key)
    assert path.stat().st_size == HEADER_BYTES + PAGE
    assert store.get(key) == page
    assert store.get(make_key(8)) is None
    st = store.stats()
    assert (st.ssd_pages, st.ssd_bytes, st.hits, st.misses, st.puts) == (1, PAGE, 1, 1, 1)
    assert not list(tmp_path.rglob("*.tmp"))
    store.close()


def test_ssd_capacity_eviction_oldest_used_first(tmp_path: Path) -> None:
    store = SsdStore(tmp_path, 3 * PAGE)
    for i in range(3):
        store.put(make_key(i), make_page(i))
    assert store.get(make_key(0)) == make_page(0)
    store.put(make_key(3), make_page(3))
    assert not store.contains(make_key(1))
    assert not page_path(tmp_path, make_key(1)).exists()
    st = store.stats()
    assert (st.ssd_pages, st.ssd_bytes, st.evicted_ssd) == (3, 3 * PAGE, 1)
    assert not store.put(make_key(9), make_page(9, 3 * PAGE + 1))
    store.close()


def test_ssd_restart_restores_lru_order_and_cleans_tmp(tmp_path: Path) -> None:
    store = SsdStore(tmp_path, 10 * PAGE)
    for i in range(4):
        store.put(make_key(i), make_page(i))
    store.get(make_key(0))  # order now 1, 2, 3, 0
    store.close()
    stray = page_path(tmp_path, make_key(5)).with_name("dead.123.0.tmp")
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"half a page")
    foreign = tmp_path / "README"
    foreign.write_text("not ours")

    reopened = SsdStore(tmp_path, 2 * PAGE)  # capacity shrank: the two oldest go
    assert not stray.exists() and foreign.exists()
    assert [reopened.contains(make_key(i)) for i in range(4)] == [True, False, False, True]
    assert reopened.get(make_key(3)) == make_page(3)
    assert reopened.stats().evicted_ssd == 2
    reopened.close()


def test_ssd_directory_is_exclusive(tmp_path: Path) -> None:
    store = SsdStore(tmp_path, PAGE)
    with pytest.raises(RuntimeError):
        SsdStore(tmp_path, PAGE)
    store.close()
    SsdStore(tmp_path, PAGE).close()


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 100] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(HEADER_BYTES + PAGE // 2)


def _garbage(path: Path) -> None:
    path.write_bytes(random.Random(1).randbytes(HEADER_BYTES + PAGE))


def _wrong_key(path: Path) -> None:
    # A valid page of another key, under this key's name.
    other = SsdStore(path.parent.parent / "other", 10 * PAGE)
    other.put(make_key(99), make_page(99))
    os.replace(page_path(other.directory, make_key(99)), path)
    other.close()


def _flip_header_checksum(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES - 8] ^= 0x80  # inside the checksum field: only the payload read sees it
    path.write_bytes(bytes(data))


CORRUPTIONS = [_flip_payload_byte, _truncate, _garbage, _wrong_key, _flip_header_checksum]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_ssd_corruption_detected_on_read(tmp_path: Path, corrupt) -> None:
    directory = tmp_path / "pages"
    store = SsdStore(directory, 10 * PAGE)
    key = make_key(1)
    store.put(key, make_page(1))
    store.put(make_key(2), make_page(2))
    corrupt(page_path(directory, key))
    assert store.contains(key)
    assert store.get(key) is None
    st = store.stats()
    assert (st.corrupt_dropped, st.misses, st.ssd_pages, st.ssd_bytes) == (1, 1, 1, PAGE)
    assert not page_path(directory, key).exists() and not store.contains(key)
    assert store.get(make_key(2)) == make_page(2)
    store.close()


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_ssd_corruption_detected_after_restart(tmp_path: Path, corrupt) -> None:
    directory = tmp_path / "pages"
    store = SsdStore(directory, 10 * PAGE)
    key = make_key(1)
    store.put(key, make_page(1))
    store.put(make_key(2), make_page(2))
    store.close()
    corrupt(page_path(directory, key))
    reopened = SsdStore(directory, 10 * PAGE)
    # Header damage is caught by the scan; payload damage when the page is read.
    assert reopened.get(key) is None
    assert reopened.stats().corrupt_dropped == 1
    assert not page_path(directory, key).exists()
    assert reopened.get(make_key(2)) == make_page(2)
    reopened.close()


# -- TieredStore -----------------------------------------------------------------------------


def test_tiered_ram_only_loses_evicted_pages() -> None:
    store = TieredStore(2 * PAGE)
    for i in range(3):
        assert store.put(make_key(i), make_page(i))
    assert store.get(make_key(0)) is None
    assert store.get(make_key(2)) == make_page(2)
    assert not store.put(make_key(5), make_page(5, 2 * PAGE + 1))
    st = store.stats()
    assert (st.ram_pages, st.ssd_pages, st.hits, st.misses, st.puts) == (2, 0, 1, 1, 3)
    store.close()
    with pytest.raises(RuntimeError):
        store.put(make_key(9), make_page(9))


def test_tiered_write_through_promotion_and_restart(tmp_path: Path) -> None:
    store = TieredStore(2 * PAGE, tmp_path, 16 * PAGE)
    pages = {make_key(i): make_page(i) for i in range(6)}
    for key, page in pages.items():
        assert store.put(key, page)
    store.flush()
    st = store.stats()
    assert (st.ram_pages, st.ssd_pages, st.ssd_pending_pages, st.evicted_ram) == (2, 6, 0, 4)

    cold = make_key(0)
    assert not store.ram.contains(cold) and store.contains(cold)
    assert store.get(cold) == pages[cold]
    assert store.ram.contains(cold)  # promoted
    st = store.stats()
    assert (st.hits, st.ssd_hits, st.misses) == (1, 1, 0)
    store.close()

    restarted = TieredStore(2 * PAGE, tmp_path, 16 * PAGE)
    assert restarted.stats().ssd_pages == 6
    for key, page in pages.items():
        assert restarted.get(key) == page
    assert restarted.get(make_key(42)) is None
    st = restarted.stats()
    assert (st.hits, st.ssd_hits, st.misses, st.corrupt_dropped) == (6, 6, 1, 0)
    restarted.close()


def test_tiered_rejects_page_larger_than_either_tier(tmp_path: Path) -> None:
    store = TieredStore(4 * PAGE, tmp_path, 2 * PAGE)
    assert store.capacity_bytes == 2 * PAGE
    assert not store.put(make_key(1), make_page(1, 3 * PAGE))
    assert store.stats() == StoreStats()
    store.close()


class _GatedSsdPut:
    """Replaces SsdStore.put so that a test decides when (and whether) writes succeed."""

    def __init__(self, real, fail: bool = False) -> None:
        self.real = real
        self.fail = fail
        self.gate = threading.Event()

    def __call__(self, key: bytes, value: bytes) -> bool:
        assert self.gate.wait(5)
        if self.fail:
            raise OSError(28, "No space left on device")
        return self.real(key, value)


def test_tiered_pending_pages_are_served_and_put_blocks_when_queue_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TieredStore(PAGE, tmp_path, 16 * PAGE, max_pending_pages=2)
    gated = _GatedSsdPut(store.ssd.put)
    monkeypatch.setattr(store.ssd, "put", gated)
    store.put(make_key(0), make_page(0))
    store.put(make_key(1), make_page(1))  # evicts 0 from RAM before it reached disk
    assert not store.ram.contains(make_key(0))
    assert store.get(make_key(0)) == make_page(0)  # served from the queue
    assert store.put(make_key(1), make_page(1))  # a re-put of a pending key never blocks

    done = threading.Event()
    blocked = threading.Thread(target=lambda: (store.put(make_key(2), make_page(2)), done.set()))
    blocked.start()
    assert not done.wait(0.2)  # queue full: put waits for the writer
    gated.gate.set()
    assert done.wait(5)
    blocked.join()
    store.flush()
    assert store.stats().ssd_pages == 3 and store.stats().ssd_pending_pages == 0
    store.close()


def test_tiered_writer_errors_are_counted_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TieredStore(4 * PAGE, tmp_path, 16 * PAGE)
    gated = _GatedSsdPut(store.ssd.put, fail=True)
    gated.gate.set()
    monkeypatch.setattr(store.ssd, "put", gated)
    for i in range(3):
        assert store.put(make_key(i), make_page(i))
    store.flush()
    st = store.stats()
    assert (st.ssd_write_errors, st.ssd_pages, st.ram_pages) == (3, 0, 3)
    assert store.get(make_key(1)) == make_page(1)  # still served from RAM
    gated.fail = False
    store.put(make_key(3), make_page(3))  # the writer survived the failures
    store.flush()
    assert store.stats().ssd_pages == 1
    store.close()


def test_tiered_corrupt_ssd_page_is_a_miss(tmp_path: Path) -> None:
    store = TieredStore(PAGE, tmp_path, 16 * PAGE)
    store.put(make_key(0), make_page(0))
    store.put(make_key(1), make_page(1))
    store.flush()
    _flip_payload_byte(page_path(tmp_path, make_key(0)))
    assert store.get(make_key(0)) is None
    st = store.stats()
    assert (st.misses, st.corrupt_dropped, st.ssd_pages) == (1, 1, 1)
    store.close()


def test_ram_hits_keep_pages_fresh_on_ssd(tmp_path: Path) -> None:
    store = TieredStore(2 * PAGE, tmp_path, 2 * PAGE)
    store.put(make_key(0), make_page(0))
    store.put(make_key(1), make_page(1))
    store.flush()
    assert store.get(make_key(0)) == make_page(0)  # a RAM hit; SSD order must become 1, 0
    store.put(make_key(2), make_page(2))
    store.flush()
    assert store.ssd.contains(make_key(0)) and not store.ssd.contains(make_key(1))
    store.close()


@pytest.mark.parametrize("with_ssd", [False, True], ids=["ram", "ram+ssd"])
def test_concurrent_put_get(tmp_path: Path, with_ssd: bool) -> None:
    pages = {make_key(i): make_page(i, 256 + 64 * (i % 4)) for i in range(48)}
    keys = list(pages)
    if with_ssd:
        store = TieredStore(6 * 512, tmp_path, 24 * 512, max_pending_pages=4)
    else:
        store = TieredStore(12 * 512)
    errors: list[BaseException] = []
    wrong: list[bytes] = []
    stop = time.monotonic() + 1.0

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                key = rng.choice(keys)
                if rng.random() < 0.4:
                    store.put(key, pages[key])
                else:
                    value = store.get(key)
                    if value is not None and value != pages[key]:
                        wrong.append(key)
                if time.monotonic() > stop:
                    break
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong
    store.flush()
    st = store.stats()
    assert st.ram_bytes <= 12 * 512 and st.ssd_bytes <= 24 * 512
    assert st.corrupt_dropped == 0 and st.ssd_write_errors == 0 and st.ssd_pending_pages == 0
    assert st.ssd_hits <= st.hits
    store.close()
    if with_ssd:
        restarted = TieredStore(6 * 512, tmp_path, 24 * 512)
        assert restarted.stats().ssd_pages == st.ssd_pages
        for key in keys:
            value = restarted.get(key)
            assert value is None or value == pages[key]
        assert restarted.stats().corrupt_dropped == 0
        restarted.close()


@pytest.mark.parametrize("with_ssd", [False, True])
def test_clear_drops_every_tier(tmp_path: Path, with_ssd: bool) -> None:
    store = TieredStore(2 * PAGE, tmp_path if with_ssd else None, 16 * PAGE)
    pages = {make_key(i): make_page(i) for i in range(6)}
    for key, page in pages.items():
        assert store.put(key, page)
    # With SSD: 2 pages in RAM (and on SSD), 4 on SSD only, some perhaps still queued; each
    # counts once. Without: RAM kept the last 2.
    assert store.clear() == (6 if with_ssd else 2)
    st = store.stats()
    assert (st.ram_pages, st.ram_bytes, st.ssd_pages, st.ssd_bytes) == (0, 0, 0, 0)
    assert st.ssd_pending_pages == 0 and st.evicted_ram == 4 and st.evicted_ssd == 0
    assert not any(store.contains(key) or store.get(key) for key in pages)
    assert not any(tmp_path.glob("*/*.page"))
    assert store.clear() == 0
    assert store.put(make_key(7), make_page(7)) and store.get(make_key(7)) == make_page(7)
    store.close()
    if with_ssd:  # what a restart finds: the page put after the clear, only
        restarted = TieredStore(2 * PAGE, tmp_path, 16 * PAGE)
        assert restarted.stats().ssd_pages == 1 and restarted.contains(make_key(7))
        restarted.close()
