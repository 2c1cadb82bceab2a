"""An aborted request's claims are released: its waiters compute at once instead of sitting out
the whole coalescing wait.

The ledger is checked against a real store server (in process, real sockets); the end-to-end
test aborts a queued request on a real SGLang instance and times the request that needed its
pages on another instance.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from banaserve.kvstore.client import KvStoreClient
from banaserve.sglang_ext.abort_release import ClaimLedger
from banaserve.utils.processes import ManagedProcess
from conftest import Server, start_server
from test_kvstore_claims import Background, server_stats, wait_until, waiting
from test_kvstore_claims import server as store  # noqa: F401 - a fresh in-process store server
from test_kvstore_server import TOKEN, InProcessServer, keys_for
from test_kvstore_sglang import TOKEN as SHARD_TOKEN
from test_kvstore_sglang import start_shard


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


# -- end to end --------------------------------------------------------------------------------

COALESCE_WAIT_S = 40.0


def prompt(seed: int) -> str:
    words = ["amber", "cobalt", "delta", "ember", "fjord", "granite", "hazel", "indigo"]
    return " ".join(words[(seed * 7 + i * i) % len(words)] + str(i % 13) for i in range(300))


@pytest.fixture(scope="module")
def one_slot_pair(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    """Two instances on one store: ``busy`` runs one request at a time (so another one waits
    in its queue, its pages claimed), ``other`` is free."""
    logs = tmp_path_factory.mktemp("abort-release")
    env = dict(os.environ, BANASERVE_KV_STORE_TOKEN=SHARD_TOKEN)
    processes: list[ManagedProcess] = []
    try:
        shard, url = start_shard(logs, "shard")
        processes.append(shard)
        store_args = ("--kv-store", url, "--kv-store-coalesce-wait-s", str(COALESCE_WAIT_S))
        busy = start_server(tiny_model, logs / "busy.log", *store_args,
                            "--max-running-requests", "1", env=env)  # fmt: skip
        other = start_server(tiny_model, logs / "other.log", *store_args, env=env)
        processes += [busy.process, other.process]
        busy.wait_ready()
        other.wait_ready()
        # SGLang JIT-builds its HiCache hash extension at a server's first storage lookup (about
        # 25 s when the build cache holds another checkout's build): not what is timed here.
        for server in (busy, other):
            generate(server, prompt(seed=99))
        yield busy, other
    finally:
        for process in reversed(processes):
            process.stop()


def generate(server: Server, text: str, rid: str | None = None, tokens: int = 4) -> dict:
    body: dict = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": tokens,
                                                    "ignore_eos": True}}  # fmt: skip
    if rid is not None:
        body["rid"] = rid
    return requests.post(f"{server.url}/generate", json=body, timeout=300).json()


def test_a_queued_request_aborted_does_not_hold_up_its_prefix(
    one_slot_pair: tuple[Server, Server],
) -> None:
    busy, other = one_slot_pair
    text = prompt(seed=11)
    # The only running slot of ``busy`` is taken by a long generation; ``queued`` waits
    # behind it with its pages claimed in the store, and is aborted there.
    long_run = threading.Thread(target=generate, args=(busy, "count: one two", None, 1500))
    long_run.start()
    time.sleep(1.0)
    queued = Background(lambda: generate(busy, text, rid="queued-1"))
    time.sleep(2.0)
    assert not queued.done(), "the queued request was not held behind the long one"
    abort = requests.post(f"{busy.url}/abort_request", json={"rid": "queued-1"}, timeout=30)
    assert abort.status_code == 200
    aborted = queued.result(timeout=60)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"

    started = time.monotonic()
    result = generate(other, text)
    elapsed = time.monotonic() - started
    assert len(result["output_ids"]) == 4
    # Without the release, ``other`` would wait COALESCE_WAIT_S for pages no one computes.
    assert elapsed < COALESCE_WAIT_S / 2, f"the prefix was held up {elapsed:.1f} s"
    long_run.join(timeout=300)
