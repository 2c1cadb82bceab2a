"""The store's memory bounds and security defaults, in process (issue 13, items 4 and 5):
the byte budgets, the authenticator and tenant token files, and in-process servers under
stalled frames, failed requests, large GET replies and tenants' claims.

The hostile clients against a real store process are ``e2e/test_kvstore_hardening.py``.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

import store_hostile as hostile
from banaserve.kvstore.admission import (
    ByteBudget,
    Ticket,
    inflight_budget,
)
from banaserve.kvstore.auth import (
    OPEN,
    Authenticator,
    Grant,
    check_server_proof,
    client_proof,
    load_tenant_tokens,
)
from banaserve.kvstore.client import KvStoreClient
from banaserve.kvstore.protocol import NONCE_BYTES, ErrorCode, ProtocolError
from banaserve.kvstore.server import ServerConfig
from banaserve.kvstore.server import conn as server_conn
from banaserve.kvstore.storage import TieredStore
from support.kvstore_hardening import CAPACITY, TOKEN, MiB
from support.kvstore_server import InProcessServer

# -- memory bounded before it is allocated ----------------------------------------------------


def test_budget_waits_then_refuses_busy() -> None:
    budget = ByteBudget(100)
    assert budget.request_cap == 25

    async def scenario() -> None:
        first, second = Ticket(budget), Ticket(budget)
        await first.take(25, 0.0, "PUT")
        filler = [Ticket(budget) for _ in range(3)]
        assert all(ticket.try_take(25, "PUT") for ticket in filler)
        assert budget.in_use == 100
        with pytest.raises(ProtocolError) as busy:
            await second.take(10, 0.05, "PUT")
        assert busy.value.code is ErrorCode.BUSY and budget.busy == 1
        waiter = asyncio.ensure_future(second.take(10, 5.0, "PUT"))
        await asyncio.sleep(0)
        assert not waiter.done()
        # A release on another thread (the ucx:// listener's) wakes the waiter.
        threading.Thread(target=first.release).start()
        await asyncio.wait_for(waiter, 5.0)
        assert second.held == 10 and budget.in_use == 85
        with pytest.raises(ProtocolError) as big:
            await second.take(20, 0.0, "GET reply")  # 30 > one request's share of 25
        assert big.value.code is ErrorCode.TOO_LARGE
        for ticket in (second, *filler):
            ticket.release()
        assert budget.in_use == 0 and budget.peak == 100

    asyncio.run(scenario())


def test_inflight_budget_follows_capacity() -> None:
    assert inflight_budget(CAPACITY) == CAPACITY // 4
    assert inflight_budget(1 << 20) == 16 * MiB  # the floor
    with pytest.raises(ValueError):
        inflight_budget(CAPACITY, 0)


def test_stalled_frame_gives_its_budget_back() -> None:
    store = TieredStore(64 * MiB)
    server = InProcessServer(store, ServerConfig(token=TOKEN, frame_timeout=0.3))
    try:
        host, port = server.url.removeprefix("tcp://").rsplit(":", 1)
        sock = hostile.connect(host, int(port), TOKEN)
        stalled = hostile.Peer(sock, hostile.put_head([hostile.key("stall")], [MiB]) + bytes(10))
        assert hostile.pump_until([stalled], lambda: stalled.error is not None, 10.0)
        assert "frame not received within 0.3 s" in stalled.error["message"]  # type: ignore[index]
        stalled.close()
        budget = server.server.admission.budget
        deadline = time.monotonic() + 10
        while budget.in_use and time.monotonic() < deadline:
            time.sleep(0.01)
        assert budget.in_use == 0 and budget.peak >= MiB
    finally:
        server.close()
        store.close()


def test_failed_request_frees_its_buffers_without_the_gc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that dies mid-PUT: its payload buffer is freed before its budget comes back,
    with the cyclic GC off (asyncio's tasks put a failed frame's traceback in a cycle, and an
    idle server would never run the GC: the buffers stayed until then)."""
    made: list[weakref.ref[bytearray]] = []

    def live() -> int:
        return sum(ref() is not None for ref in made)

    class Tracked(bytearray):
        pass

    def tracked_buffer(nbytes: int) -> bytearray:
        buffer = Tracked(nbytes)
        made.append(weakref.ref(buffer))
        return buffer

    monkeypatch.setattr(server_conn, "request_buffer", tracked_buffer)
    store = TieredStore(64 * MiB)
    server = InProcessServer(store, ServerConfig(token=TOKEN))
    budget = server.server.admission.budget
    gc.disable()
    try:
        host, port = server.url.removeprefix("tcp://").rsplit(":", 1)
        sock = hostile.connect(host, int(port), TOKEN)
        handshake = len(made)  # HELLO's and AUTH's control maps
        dying = hostile.Peer(sock, hostile.put_head([hostile.key("dies")], [4 * MiB]) + bytes(MiB))
        assert hostile.pump_until([dying], lambda: dying.done_sending, 10.0)
        deadline = time.monotonic() + 10
        while len(made) < handshake + 2 and time.monotonic() < deadline:  # control, payload
            time.sleep(0.01)
        assert budget.in_use > 4 * MiB
        dying.close()
        while budget.in_use and time.monotonic() < deadline:
            time.sleep(0.01)
        assert budget.in_use == 0 and live() == 0
    finally:
        gc.enable()
        server.close()
        store.close()


def test_get_replies_are_charged_and_split() -> None:
    """AUTH tells clients one request's share; a big GET is split to fit, and its pages are
    charged while they are sent."""
    store = TieredStore(256 * MiB)
    server = InProcessServer(store, ServerConfig(token=TOKEN, inflight_bytes=32 * MiB))
    try:
        with KvStoreClient(server.url, token=TOKEN) as client:
            keys = [hostile.key(f"big get {i}") for i in range(12)]
            data = [np.full(MiB, i, np.uint8) for i in range(12)]
            assert client.put(keys, data) == [True] * 12
            out = [np.zeros(MiB, np.uint8) for _ in keys]
            assert client.get(keys, out) == [True] * 12
            assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
            stats = client.stats()[server.url]["server"]
        assert stats["max_payload"] == 7 * MiB  # a quarter of 32 MiB, less a control map
        assert stats["inflight_peak"] <= 8 * MiB and stats["inflight_bytes"] <= 1
    finally:
        server.close()
        store.close()


# -- secure by default ------------------------------------------------------------------------


def test_tenant_isolation_holds_for_claims() -> None:
    """A tenant's LOOKUP never waits for, nor sees, another tenant's claim on the same key."""
    tokens = {"alpha": "alpha-token-0123456789", "beta": "beta-token-0123456789"}
    store = TieredStore(16 * MiB)
    server = InProcessServer(store, ServerConfig(tenant_tokens=tokens))
    try:
        keys = [hostile.key("claimed")]
        with (
            KvStoreClient(server.url, token=tokens["alpha"]) as a,
            KvStoreClient(server.url, token=tokens["beta"]) as b,
        ):
            assert a.lookup(keys, owner="same-owner") == 0
            assert b.lookup(keys, owner="other", wait_s=5.0) == 0  # alpha's claim is not seen
            stats = server.server.ops.counters  # a tenant's STATS shows its own requests only
            assert stats["claim_waits"] == 0 and stats["claims"] == 2
            assert a.release(keys, owner="same-owner") == [True]
            assert b.release(keys, owner="same-owner") == [False]  # alpha's claim is not beta's
    finally:
        server.close()
        store.close()


def test_authenticator() -> None:
    auth = Authenticator("shared-0123456789", {"t": "tenant-0123456789"})
    mine, theirs = b"c" * NONCE_BYTES, b"s" * NONCE_BYTES

    def offer(token: str) -> tuple[Grant, bytes | None]:
        return auth.authenticate(client_proof(token, mine, theirs), mine, theirs)

    grant, server_proof = offer("shared-0123456789")
    assert grant.tenant is None
    check_server_proof("shared-0123456789", mine, theirs, server_proof)  # the server knows it
    grant, server_proof = offer("tenant-0123456789")
    assert grant.tenant == "t"
    check_server_proof("tenant-0123456789", mine, theirs, server_proof)
    with pytest.raises(ProtocolError, match="did not prove"):  # one token's proof is not another's
        check_server_proof("shared-0123456789", mine, theirs, server_proof)
    for wrong in ("shared-012345678", "tenant-0123456789x"):
        with pytest.raises(ProtocolError) as info:
            offer(wrong)
        assert info.value.code is ErrorCode.AUTH
    # A proof is good for its nonces only: replayed on a connection with another server nonce.
    replayed = client_proof("shared-0123456789", mine, theirs)
    with pytest.raises(ProtocolError, match="authentication failed"):
        auth.authenticate(replayed, mine, b"x" * NONCE_BYTES)
    with pytest.raises(ProtocolError, match="authentication failed"):
        auth.authenticate(None, mine, theirs)
    assert Authenticator().authenticate(None, mine, theirs) == (OPEN, None)  # no token at all
    with pytest.raises(ProtocolError, match="did not prove"):  # such a store proves nothing
        check_server_proof("shared-0123456789", mine, theirs, None)
    check_server_proof(None, mine, theirs, None)  # a client without a token checks nothing
    with pytest.raises(ValueError, match="twice"):
        Authenticator("same-token", {"t": "same-token"})
    with pytest.raises(ValueError, match="tenant name"):
        Authenticator(None, {"a:b": "x"})
    key = hostile.key("k")
    a, b = Grant("a").map_keys([key]), Grant("b").map_keys([key])
    assert a != b and len(a[0]) == 32 and Grant().map_keys([key]) == [key]


def test_tenant_token_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    file = tmp_path / "tokens"
    file.write_text("\n# comment\n alpha : alpha-token-0123456789 \nbeta:short\n")
    file.chmod(0o644)
    assert load_tenant_tokens(file) == {"alpha": "alpha-token-0123456789", "beta": "short"}
    assert "readable by other users" in caplog.text and "short token" in caplog.text
    file.write_text("alpha\n")
    with pytest.raises(ValueError, match="expected 'tenant:token'"):
        load_tenant_tokens(file)
    file.write_text("a:x-0123456789abcdef\na:y-0123456789abcdef\n")
    with pytest.raises(ValueError, match="given twice"):
        load_tenant_tokens(file)
