"""In-flight prefix coalescing: LOOKUP waits for keys another owner is computing, claims the
missing tail, and claims end on PUT, release, lease expiry or the claiming connection's close.

Servers run in process on real sockets (one per test, so its counters are this test's alone).
Clients that must die for real are separate processes, in
``e2e/test_kvstore_claims_killed_clients.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from banaserve.kvstore.claims import ClaimTable
from banaserve.kvstore.client import KvStoreClient
from banaserve.kvstore.protocol import MAX_OWNER_CHARS, MAX_WAIT_MS, Op, encode_frame
from banaserve.kvstore.server import ServerConfig
from banaserve.kvstore.storage import TieredStore
from support.kvstore_claims import (
    Background,
    in_process_server,
    server_stats,
    wait_until,
    waiting,
)
from support.kvstore_server import TOKEN, InProcessServer, exchange, keys_for, pages

#: a fresh in-process store server for each test
server = pytest.fixture(in_process_server)

PAGE = 1024


# -- the claim table alone --------------------------------------------------------------------


def test_claim_table_renew_takeover_bound_and_holder() -> None:
    now = [100.0]
    table = ClaimTable(max_claims=2, clock=lambda: now[0])
    a, b, conn1, conn2 = b"a" * 32, b"b" * 32, object(), object()
    assert table.claim(a, "A", conn1, 1.0)
    assert not table.claim(a, "B", conn2, 1.0)  # held by another owner
    assert table.claim(a, "A", conn2, 5.0)  # renewed, and moved to conn2
    assert table.drop_holder(conn1) == 0 and table.holder(a) is not None
    assert table.claim(b, "B", conn2, 1.0)
    assert not table.claim(b"c" * 32, "C", conn1, 1.0)  # full
    now[0] += 2.0  # b expired, a (renewed for 5 s) not
    assert table.claim(b"c" * 32, "C", conn1, 1.0)  # a sweep made room
    assert table.expired == 1
    assert table.claim(a, "B", conn1, 1.0, force=True) and table.holder(a).owner == "B"
    assert not table.release(a, "A") and table.release(a, "B")
    assert table.drop_holder(conn1) == 1 and len(table) == 0


def test_claim_table_wait_wakes_on_store_and_times_out() -> None:
    now = [100.0]

    async def scenario() -> None:
        table = ClaimTable(clock=lambda: now[0])
        key = b"k" * 32
        table.claim(key, "A", "conn", 60.0)
        claim = table.holder(key)
        assert claim is not None
        waiter = asyncio.create_task(table.wait(claim, now[0] + 5))
        await asyncio.sleep(0)  # the waiter is suspended on the claim now
        assert not waiter.done()
        table.stored([key])
        await asyncio.wait_for(waiter, 5)  # woken by the store, not by its deadline
        assert claim.done
        table.claim(key, "A", "conn", 60.0)
        again = table.holder(key)
        assert again is not None
        now[0] += 1.0
        # The deadline has come, not the 60 s lease: it returns at once (a wait for the lease
        # would time the test out).
        await asyncio.wait_for(table.wait(again, now[0]), 5)
        assert not again.done
        lapsed = table.holder(key)
        assert lapsed is again
        now[0] += 60.0
        await asyncio.wait_for(table.wait(lapsed, now[0] + 5), 5)  # the lease ran out first
        assert table.holder(key) is None

    asyncio.run(scenario())


def test_claim_table_clear_ends_every_claim() -> None:
    table = ClaimTable()
    a, b, conn = b"a" * 32, b"b" * 32, object()
    assert table.claim(a, "A", conn, 60.0) and table.claim(b, "B", "other", 60.0)
    claim = table.holder(a)
    assert claim is not None
    assert table.clear() == 2 and len(table) == 0 and claim.done
    assert table.drop_holder(conn) == 0  # nothing left tied to the connection
    assert table.claim(a, "C", conn, 1.0)  # free again
    assert table.clear() == 1 and table.clear() == 0


#: A wait that something must end (a PUT, a clear, a close, a lease) is this long, and it must
#: end within WOKEN_WITHIN_S: a wait left to run out fails on any machine, and a slow machine
#: still wakes in time (until issue 35: waits of 20-30 s that had to end within 3-10 s).
LONG_WAIT_S = 120.0
WOKEN_WITHIN_S = 60.0


# -- one server ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["tcp", "shm"])
def test_waiter_gets_the_pages_the_claimant_puts(server: InProcessServer, scheme: str) -> None:
    url = server.url.replace("tcp://", f"{scheme}://")
    keys, data = keys_for(f"coalesce {scheme}", 4), pages(4, PAGE, seed=1)
    with KvStoreClient(url, token=TOKEN) as a, KvStoreClient(url, token=TOKEN) as b:
        a.put(keys[:1], data[:1])
        assert a.lookup(keys, owner="A", wait_s=0) == 1  # claims keys 1..3
        assert server_stats(server.url)["claims"] == 3
        assert a.lookup(keys, owner="A", wait_s=5) == 1  # its own claims: renewed, no wait
        waiter = Background(lambda: b.lookup(keys, owner="B", wait_s=LONG_WAIT_S))
        wait_until(waiting(server.url))
        assert not waiter.done()
        put_at = time.monotonic()
        assert a.put(keys[1:], data[1:]) == [True] * 3
        assert waiter.result(timeout=LONG_WAIT_S) == 4
        assert waiter.finished is not None and waiter.finished >= put_at
        assert waiter.elapsed < WOKEN_WITHIN_S
        out = [bytearray(PAGE) for _ in keys]
        assert b.get(keys, out) == [True] * 4
    stats = server_stats(server.url)
    assert stats["coalesced"] == 3 and stats["claim_waits"] == 1
    assert stats["wait_timeouts"] == 0 and stats["claims_held"] == 0


def test_a_claimed_run_too_short_to_load_is_not_waited_for(server: InProcessServer) -> None:
    """Two prompts sharing one page (a chat template): the second computes its prompt at once
    rather than wait for the first one's whole prefill to store that page, since a hit that
    short would not be loaded (``min_wait_keys``, SGLang's prefetch threshold in pages); it
    still claims its own pages, and a run long enough is waited for as before."""
    shared, data = keys_for("template", 3), pages(6, PAGE, seed=3)
    first, second = shared[:1] + keys_for("first turn", 2), shared[:1] + keys_for("second", 2)
    with KvStoreClient(server.url, token=TOKEN) as a, KvStoreClient(server.url, token=TOKEN) as b:
        assert a.lookup(first, owner="A") == 0  # claims the shared page and its own two
        start = time.monotonic()
        assert b.lookup(second, owner="B", wait_s=LONG_WAIT_S, min_wait_keys=2) == 0
        assert time.monotonic() - start < WOKEN_WITHIN_S  # a wait would run till A's put
        assert server_stats(server.url)["claim_waits"] == 0
        assert b.release(second, owner="B") == [False, True, True]  # its own, not A's page
        # A run as long as min_wait_keys is waited for: B loads what A puts.
        assert a.lookup(shared, owner="A") == 0
        waiter = Background(lambda: b.lookup(shared + second[1:], owner="B",
                                             wait_s=LONG_WAIT_S, min_wait_keys=3))  # fmt: skip
        wait_until(waiting(server.url))
        assert a.put(shared, data[:3]) == [True] * 3
        assert waiter.result(timeout=LONG_WAIT_S) == 3 and waiter.elapsed < WOKEN_WITHIN_S
        assert b.release(second[1:], owner="B") == [True, True]  # claimed in the first round
    assert server_stats(server.url)["wait_timeouts"] == 0


def test_clear_ends_the_claims_and_wakes_their_waiters(server: InProcessServer) -> None:
    keys, stored = keys_for("clear claimed", 2), keys_for("clear stored", 3)
    with KvStoreClient(server.url, token=TOKEN) as a, KvStoreClient(server.url, token=TOKEN) as b:
        assert a.put(stored, pages(3, PAGE, seed=2)) == [True] * 3
        assert a.lookup(keys, owner="A") == 0  # claims both
        waiter = Background(lambda: b.lookup(keys, owner="B", wait_s=LONG_WAIT_S, claim=False))
        wait_until(waiting(server.url))
        assert a.clear() == 3  # the pages; and A's claims end, so B stops waiting
        assert waiter.result(timeout=LONG_WAIT_S) == 0 and waiter.elapsed < WOKEN_WITHIN_S
        assert a.exists(stored) == [False] * 3
    stats = server_stats(server.url)
    assert stats["cleared"] == 3 and stats["claims_cleared"] == 2
    assert stats["claims_held"] == 0 and stats["wait_timeouts"] == 0


def test_wait_times_out_and_the_waiter_takes_over(server: InProcessServer) -> None:
    keys = keys_for("timeout", 4)
    with KvStoreClient(server.url, token=TOKEN) as a, KvStoreClient(server.url, token=TOKEN) as b:
        assert a.lookup(keys, owner="A") == 0
        start = time.monotonic()
        assert b.lookup(keys, owner="B", wait_s=0.5) == 0
        assert 0.45 <= time.monotonic() - start < WOKEN_WITHIN_S
        stats = server_stats(server.url)
        assert stats["wait_timeouts"] == 1 and stats["claim_waits"] == 1
        assert stats["claims"] == 8  # A's 4, then B's 4 taken over
        # B holds them now: A waits for B (briefly) and B can release them.
        assert not a.release(keys, owner="A")[0]
        assert b.release(keys, owner="B") == [True] * 4
        assert a.lookup(keys, owner="A", claim=False) == 0
    assert server_stats(server.url)["claims_held"] == 0


def test_closed_claimant_connection_ends_its_claims(server: InProcessServer) -> None:
    keys = keys_for("closed client", 3)
    a = KvStoreClient(server.url, token=TOKEN)
    with KvStoreClient(server.url, token=TOKEN) as b:
        assert a.lookup(keys, owner="A") == 0
        waiter = Background(lambda: b.lookup(keys, owner="B", wait_s=LONG_WAIT_S))
        wait_until(waiting(server.url))
        closed_at = time.monotonic()
        a.close()
        assert waiter.result(timeout=LONG_WAIT_S) == 0
        assert waiter.finished is not None and waiter.finished - closed_at < WOKEN_WITHIN_S
        assert b.release(keys, owner="B") == [True] * 3  # B claimed them itself
    assert server_stats(server.url)["wait_timeouts"] == 0


def test_lease_expiry_ends_the_wait(server: InProcessServer) -> None:
    keys = keys_for("lease", 2)
    with KvStoreClient(server.url, token=TOKEN) as a, KvStoreClient(server.url, token=TOKEN) as b:
        assert a.lookup(keys, owner="A", lease_s=0.5) == 0
        start = time.monotonic()
        assert b.lookup(keys, owner="B", wait_s=LONG_WAIT_S) == 0
        assert 0.4 <= time.monotonic() - start < WOKEN_WITHIN_S
        stats = server_stats(server.url)
        assert stats["claims_expired"] >= 1 and stats["wait_timeouts"] == 0
        assert b.release(keys, owner="B") == [True, True]


def test_server_serves_others_while_a_lookup_waits(server: InProcessServer) -> None:
    keys, other = keys_for("blocked", 2), keys_for("bystander", 3)
    data = pages(3, PAGE, seed=2)
    with (
        KvStoreClient(server.url, token=TOKEN) as a,
        KvStoreClient(server.url, token=TOKEN) as b,
        KvStoreClient(server.url.replace("tcp://", "shm://"), token=TOKEN) as c,
    ):
        assert a.lookup(keys, owner="A") == 0
        waiter = Background(lambda: b.lookup(keys, owner="B", wait_s=20))
        wait_until(waiting(server.url))
        assert c.put(other, data) == [True] * 3
        assert c.exists(other) == [True] * 3
        out = [bytearray(PAGE) for _ in other]
        assert c.get(other, out) == [True] * 3
        assert c.lookup(other, owner="C", wait_s=5) == 3
        # The same client's other connections also stay usable while its lookup waits.
        assert b.exists(other) == [True] * 3
        # Served while it waits: a server that queued them behind it would answer only once
        # the lookup's 20 s wait ended.
        assert not waiter.done()
        a.release(keys, owner="A")
        assert waiter.result() == 0


BAD_LOOKUPS = {
    "negative wait": ({"wait_ms": -1}, "'wait_ms' must be in [0, 120000]"),
    "huge wait": ({"wait_ms": MAX_WAIT_MS + 1}, "'wait_ms' must be in"),
    "zero lease": ({"lease_ms": 0}, "'lease_ms' must be in [1, 120000]"),
    "owner not a string": ({"owner": 5}, "'owner' must be str"),
    "empty owner": ({"owner": ""}, "'owner' must be 1 to 256"),
    "long owner": ({"owner": "x" * (MAX_OWNER_CHARS + 1)}, "'owner' must be 1 to 256"),
    "claim not a bool": ({"claim": 1}, "'claim' must be bool"),
    "wait as bool": ({"wait_ms": True}, "must be int, got bool"),
    "no claim field": ({"claim": None}, "missing field 'claim'"),
}


def test_bad_lookups_are_refused_and_change_nothing(server: InProcessServer) -> None:
    keys = keys_for("bad lookup", 2)
    for case, (changes, message) in BAD_LOOKUPS.items():
        control = {"keys": keys, "owner": "A", "wait_ms": 0, "lease_ms": 1000, "claim": True}
        control.update(changes)
        control = {k: v for k, v in control.items() if v is not None}
        replies = exchange(server.url, encode_frame(Op.LOOKUP, 2, control), TOKEN)
        assert replies[-1].op is Op.ERROR, case
        assert message in replies[-1].control["message"], (case, replies[-1].control)
    bad_release = encode_frame(Op.RELEASE, 2, {"keys": keys, "owner": 7})
    assert exchange(server.url, bad_release, TOKEN)[-1].op is Op.ERROR
    stats = server_stats(server.url)
    assert stats["claims"] == 0 and stats["claims_held"] == 0
    assert stats["refused"] == len(BAD_LOOKUPS) + 1
    with KvStoreClient(server.url, token=TOKEN) as client:
        with pytest.raises(ValueError, match="wait_s"):
            client.lookup(keys, owner="A", wait_s=-1)
        with pytest.raises(ValueError, match="owner"):
            client.lookup(keys, owner="")
        with pytest.raises(ValueError, match="lease_s"):
            client.lookup(keys, owner="A", lease_s=0)
        assert client.lookup([], owner="A") == 0


# -- two shards ---------------------------------------------------------------------------------


@pytest.fixture
def two_shards(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[InProcessServer]]:
    """Two in-process shards; a shard a test closes stays down for the client (no retry)."""
    monkeypatch.setattr(KvStoreClient, "RETRY_AFTER_S", 30.0)
    stores = [TieredStore(64 << 20), TieredStore(64 << 20)]
    servers = [InProcessServer(s, ServerConfig(token=TOKEN)) for s in stores]
    try:
        yield servers
    finally:
        for srv in servers:
            if srv.thread.is_alive():
                srv.close()
        for store in stores:
            store.close()


def test_two_shards_spread_claims_and_coalesce(two_shards: list[InProcessServer]) -> None:
    servers, urls = two_shards, [s.url for s in two_shards]
    keys, data = keys_for("two shards", 24), pages(24, PAGE, seed=3)
    with KvStoreClient(urls, token=TOKEN) as a, KvStoreClient(urls, token=TOKEN) as b:
        assert a.put(keys[:5], data[:5]) == [True] * 5
        assert a.lookup(keys, owner="A") == 5
        claims = [server_stats(url)["claims"] for url in urls]
        assert sum(claims) == 19 and all(claims)  # the whole missing tail, both shards
        waiter = Background(lambda: b.lookup(keys, owner="B", wait_s=20))
        wait_until(lambda: sum(server_stats(url)["claim_waits"] for url in urls) >= 2)
        assert a.put(keys[5:], data[5:]) == [True] * 19
        assert waiter.result() == 24
        assert sum(server_stats(url)["coalesced"] for url in urls) == 19

        # A down shard: its keys are missing and unclaimed; the call does not raise.
        more = keys_for("two shards, one down", 16)
        on_second = [a._ring.replica_indices(k, 1)[0] == 1 for k in more]
        first_on_second = on_second.index(True)
        assert b.put(more, pages(16, PAGE, seed=4)) == [True] * 16
        servers[1].close()
        assert b.lookup(more, owner="B", wait_s=1) == first_on_second


def test_a_dead_shard_passes_its_keys_to_their_replica(two_shards: list[InProcessServer]) -> None:
    keys, data = keys_for("replicated", 16), pages(16, PAGE, seed=5)
    with KvStoreClient([s.url for s in two_shards], token=TOKEN, replication=2) as client:
        assert client.put(keys, data) == [True] * 16
        assert client.lookup(keys, owner="A") == 16  # the client has used both shards
        two_shards[0].close()  # the client learns it only from the next call's failure
        assert client.lookup(keys, owner="A", wait_s=1) == 16
