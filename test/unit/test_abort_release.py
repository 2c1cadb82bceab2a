"""An aborted request's claims are released: its waiters compute at once instead of sitting out
the whole coalescing wait.

The ledger, checked against a real store server in process (real sockets). The end-to-end
half, on real SGLang instances, is ``e2e/test_abort_release_on_instances.py``.
"""

from __future__ import annotations

import logging

import pytest

from banaserve.kvstore.client import KvStoreClient
from banaserve.sglang_ext.abort_release import ClaimLedger
from support.kvstore_claims import Background, in_process_server, server_stats, wait_until, waiting
from support.kvstore_server import TOKEN, InProcessServer, keys_for

#: a fresh in-process store server for each test
store = pytest.fixture(in_process_server)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def recording_ledger(clock: Clock | None = None) -> tuple[ClaimLedger, list[tuple[str, list]]]:
    released: list[tuple[str, list]] = []
    ledger = ClaimLedger(lambda rid, keys: released.append((rid, keys)), 60.0,
                         clock or Clock())  # fmt: skip
    return ledger, released


def test_abort_releases_what_the_request_claimed_and_nothing_else() -> None:
    ledger, released = recording_ledger()
    ledger.record("a", [b"k1", b"k2"])
    ledger.record("a", [b"k3"])  # a retried lookup adds to the claim
    ledger.record("b", [b"k9"])
    ledger.abort("a")
    assert released == [("a", [b"k1", b"k2", b"k3"])]
    ledger.abort("a")  # twice: nothing more to release
    ledger.abort("never-seen")
    assert released == [("a", [b"k1", b"k2", b"k3"])]
    assert len(ledger) == 1  # b finishes normally: its claims end when its pages are stored


def test_an_abort_before_the_lookup_finished_releases_on_record() -> None:
    ledger, released = recording_ledger()
    ledger.abort("a")
    ledger.record("a", [b"k1"])
    assert released == [("a", [b"k1"])]
    assert len(ledger) == 0


def test_entries_last_one_lease() -> None:
    clock = Clock()
    ledger, released = recording_ledger(clock)
    for i in range(100):
        ledger.record(f"r{i}", [b"k"])
    assert len(ledger) == 100
    clock.now = 61.0  # the claims' lease is over: the store has ended them already
    ledger.record("late", [b"k"])
    assert len(ledger) == 1
    ledger.abort("r1")
    assert released == []


def test_a_failing_release_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def fail(request_id: str, keys: list[bytes]) -> None:
        raise ConnectionError("store down")

    ledger = ClaimLedger(fail, 60.0)
    ledger.record("a", [b"k1"])
    with caplog.at_level(logging.WARNING):
        ledger.abort("a")
    assert "could not release the claims of aborted request a" in caplog.text


def test_ledger_rejects_a_non_positive_lease() -> None:
    with pytest.raises(ValueError, match="lease_s must be positive"):
        ClaimLedger(lambda rid, keys: None, 0.0)


def test_waiter_on_an_aborted_claim_stops_waiting(store: InProcessServer) -> None:  # noqa: F811
    server, keys = store, keys_for("aborted", 4)
    with KvStoreClient(server.url, token=TOKEN) as a, KvStoreClient(server.url, token=TOKEN) as b:
        ledger = ClaimLedger(lambda rid, ks: a.release(ks, owner=f"A/{rid}"), 60.0)
        hit = a.lookup(keys, owner="A/r1", wait_s=0)
        ledger.record("r1", keys[hit:])
        waiter = Background(lambda: b.lookup(keys, owner="B", wait_s=20))
        wait_until(waiting(server.url))
        ledger.abort("r1")
        assert waiter.result() == 0  # nothing stored: B computes every page itself, now
        assert waiter.elapsed < 10
    stats = server_stats(server.url)
    assert stats["released"] == 4 and stats["wait_timeouts"] == 0
