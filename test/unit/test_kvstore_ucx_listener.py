"""The KV store over ucx://: a UCX listener in this process, driven by KvStoreClient.

Skipped where ucxx (the optional extra ``banaserve[ucx]``) does not import. The listener in
its own store process is ``e2e/test_kvstore_ucx.py``.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

try:
    import ucxx  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    pytest.skip(f"ucxx not importable ({exc}): install banaserve[ucx]", allow_module_level=True)

from banaserve.kvstore.client import KvStoreAuthError, KvStoreClient
from banaserve.utils.processes import free_port
from support.kvstore_ucx import PAGE, TOKEN, _pages


def test_server_down_is_a_miss() -> None:
    # Nobody listens: the first send fails at once, the shard is down, every read a miss. Had
    # any call waited for its timeout (60 s), the bound would fail on any machine (until issue
    # 35: a 2 s timeout and a 10 s bound, which a slow UCX start-up could pass or fail).
    url = f"ucx://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with KvStoreClient(url, timeout=60.0) as client:
        keys, pages = _pages(2)
        assert client.get(keys, [np.zeros(PAGE, np.uint8) for _ in keys]) == [False, False]
        assert client.exists(keys) == [False, False]
        assert client.put(keys, pages) == [False, False]
    assert time.monotonic() - started < 45.0


def test_ucx_put_wakes_tcp_waiters() -> None:
    """A page PUT over ucx:// ends the TCP server's claim on it (``on_stored``).

    Until issue 35 the PUT came 0.3 s after the waiter started (a sleep) and had to wake it
    within 3 s of a 20 s wait; now it comes once the server counts the wait, and the wait is
    120 s, so a waiter that the PUT did not wake fails the 60 s bound on any machine."""
    from banaserve.kvstore.server import ServerConfig
    from banaserve.kvstore.storage import TieredStore
    from banaserve.kvstore.ucx_server import start_ucx_listener
    from support.kvstore_claims import Background, wait_until
    from support.kvstore_server import InProcessServer

    store = TieredStore(64 << 20)
    server = InProcessServer(store, ServerConfig(token=TOKEN))
    config = server.server.config
    ucx = start_ucx_listener(store, config, "127.0.0.1", 0, on_stored=server.server.notify_stored)
    keys, pages = _pages(2)
    try:
        with (
            KvStoreClient(server.url, token=TOKEN) as a,
            KvStoreClient(server.url, token=TOKEN) as b,
            KvStoreClient(ucx.url, token=TOKEN, timeout=60.0) as u,
        ):
            assert a.lookup(keys, owner="A") == 0
            waiter = Background(lambda: b.lookup(keys, owner="B", wait_s=120))
            wait_until(lambda: a.stats()[server.url]["server"]["claim_waits"] >= 1, timeout=60)
            assert not waiter.done()
            start = time.monotonic()
            assert u.put(keys, pages) == [True, True]
            assert waiter.result(timeout=130) == 2
            assert waiter.finished is not None and waiter.finished - start < 60
    finally:
        ucx.close()
        server.close()
        store.close()


def test_tenant_tokens_over_ucx() -> None:
    """Per-tenant tokens hold over ucx:// as over tcp://: the same raw key is two pages."""
    from banaserve.kvstore.server import ServerConfig
    from banaserve.kvstore.storage import TieredStore
    from banaserve.kvstore.ucx_server import start_ucx_listener

    tokens = {"alpha": "alpha-token-0123456789", "beta": "beta-token-0123456789"}
    store = TieredStore(64 << 20)
    ucx = start_ucx_listener(store, ServerConfig(tenant_tokens=tokens), "127.0.0.1", 0)
    keys, pages = _pages(2)
    try:
        with (
            KvStoreClient(ucx.url, token=tokens["alpha"], timeout=5.0) as a,
            KvStoreClient(ucx.url, token=tokens["beta"], timeout=5.0) as b,
        ):
            assert a.put(keys[:1], pages[:1]) == [True]
            assert b.put(keys, pages[::-1]) == [True, True]
            out = [np.zeros(PAGE, np.uint8) for _ in keys]
            assert a.get(keys, out) == [True, False]  # beta's second page is not alpha's
            np.testing.assert_array_equal(out[0], pages[0])
            assert a.exists(keys) == [True, False]
            assert b.get(keys[:1], out[:1]) == [True]
            np.testing.assert_array_equal(out[0], pages[1])
        with pytest.raises(KvStoreAuthError):
            KvStoreClient(ucx.url, token=TOKEN, timeout=5.0)
    finally:
        ucx.close()
        store.close()


def test_connection_cap_and_shared_budget() -> None:
    """The ucx:// listener has a cap of its own (crashed ucx:// clients are never noticed, and
    must not lock out tcp:// ones) and charges the TCP server's in-flight budget."""
    import dataclasses

    from banaserve.kvstore.admission import ConnectionGate
    from banaserve.kvstore.server import ServerConfig
    from banaserve.kvstore.storage import TieredStore
    from banaserve.kvstore.ucx_server import start_ucx_listener
    from support.kvstore_server import InProcessServer

    store = TieredStore(64 << 20)
    server = InProcessServer(store, ServerConfig(token=TOKEN, max_connections=1))
    admission = dataclasses.replace(server.server.admission, gate=ConnectionGate(1))
    ucx = start_ucx_listener(store, server.server.config, "127.0.0.1", 0, admission=admission)
    keys, pages = _pages(1)
    try:
        with (
            KvStoreClient(server.url, token=TOKEN) as t,
            KvStoreClient(ucx.url, token=TOKEN, timeout=5.0) as u,
        ):
            assert t.put(keys, pages) == [True] and u.exists(keys) == [True]
            with KvStoreClient(ucx.url, token=TOKEN, timeout=5.0) as third:
                assert third.exists(keys) == [False]  # refused BUSY: a miss, not an error
                assert "too many connections" in third.stats()[ucx.url]["error"]
            assert admission.gate.turned_away >= 1 and admission.gate.open == 1
            out = [np.zeros(PAGE, np.uint8)]
            assert u.get(keys, out) == [True]
            assert server.server.admission.budget.peak >= PAGE  # the ucx:// GET charged it
    finally:
        ucx.close()
        server.close()
        store.close()


def test_stalled_frame_gives_its_budget_back_over_ucx() -> None:
    """A ucx:// client that sends a PUT's header and control map, then stalls: refused after
    the frame timeout, and the payload buffer's budget comes back."""
    from banaserve.kvstore.protocol import HEADER_BYTES, Op, encode_head
    from banaserve.kvstore.server import ServerConfig
    from banaserve.kvstore.storage import TieredStore
    from banaserve.kvstore.transport import parse_url
    from banaserve.kvstore.transport.ucx import Kind, UcxTransport, as_array, tag, wait_requests
    from banaserve.kvstore.ucx_server import start_ucx_listener

    store = TieredStore(64 << 20)
    config = ServerConfig(token=TOKEN, frame_timeout=0.3)
    ucx = start_ucx_listener(store, config, "127.0.0.1", 0)
    budget = ucx.admission.budget
    client = UcxTransport(parse_url(ucx.url), 5.0)
    try:
        client.connect(TOKEN)
        head = memoryview(encode_head(Op.PUT, 7, {"keys": [os.urandom(32)], "sizes": [PAGE]}, PAGE))
        tags = client._libucxx.UCXXTag
        sends = [
            client._ep.tag_send(
                as_array(head[:HEADER_BYTES]), tags(tag(client._conn_id, Kind.REQUEST_HEADER))
            ),
            client._ep.tag_send(
                as_array(head[HEADER_BYTES:]), tags(tag(client._conn_id, Kind.REQUEST_CONTROL))
            ),
        ]
        wait_requests(client._worker, sends, time.monotonic() + 5, "stall")
        deadline = time.monotonic() + 10
        while budget.peak < PAGE and time.monotonic() < deadline:
            client._worker.progress()
        assert budget.peak >= PAGE  # the payload buffer was charged
        while budget.in_use and time.monotonic() < deadline:
            client._worker.progress()
        assert budget.in_use == 0 and ucx._info()["refused"] == 1
    finally:
        client.close()
        ucx.close()
        store.close()


def test_clear_over_ucx() -> None:
    """CLEAR over ucx:// drops every page for the shared token and is refused to a tenant."""
    from banaserve.kvstore.server import ServerConfig
    from banaserve.kvstore.storage import TieredStore
    from banaserve.kvstore.ucx_server import start_ucx_listener

    tokens = {"alpha": "alpha-token-0123456789"}
    store = TieredStore(64 << 20)
    ucx = start_ucx_listener(store, ServerConfig(token=TOKEN, tenant_tokens=tokens), "127.0.0.1", 0)
    keys, pages = _pages(3)
    try:
        with (
            KvStoreClient(ucx.url, token=TOKEN, timeout=5.0) as shared,
            KvStoreClient(ucx.url, token=tokens["alpha"], timeout=5.0) as tenant,
        ):
            assert shared.put(keys[:2], pages[:2]) == [True, True]
            assert tenant.put(keys[2:], pages[2:]) == [True]
            with pytest.raises(KvStoreAuthError, match="CLEAR needs the shared token"):
                tenant.clear()
            assert tenant.exists(keys[2:]) == [True]
            assert shared.clear() == 3
            assert store.stats().ram_pages == 0
            assert shared.exists(keys[:2]) == [False, False] and tenant.exists(keys[2:]) == [False]
    finally:
        ucx.close()
        store.close()


def test_strangers_cannot_lock_out_a_peer_with_the_token_over_ucx() -> None:
    """A ucx:// stranger (connected, never authenticated) holding the strangers' only slot is
    closed to let a peer with the token in (before, that peer was turned away BUSY, and its
    requests were misses)."""
    import dataclasses

    from banaserve.kvstore.admission import ConnectionGate
    from banaserve.kvstore.server import ServerConfig
    from banaserve.kvstore.storage import TieredStore
    from banaserve.kvstore.transport import parse_url
    from banaserve.kvstore.transport.ucx import UcxTransport
    from banaserve.kvstore.ucx_server import start_ucx_listener
    from support.kvstore_server import InProcessServer

    class Stranger(UcxTransport):
        def _authenticate(self, token: str | None) -> dict:
            return {}  # holds its slot and says nothing

    def progress(stranger: Stranger, stop: threading.Event) -> None:
        # A live peer answers UCX's own traffic (the close): a frozen one blocks the
        # listener's close of it, which this test does not cover.
        while not stop.is_set():
            if stranger._worker is not None:
                stranger._worker.progress()
            time.sleep(0.001)

    store = TieredStore(64 << 20)
    server = InProcessServer(store, ServerConfig(token=TOKEN))
    gate = ConnectionGate(4, strangers=1)
    admission = dataclasses.replace(server.server.admission, gate=gate)
    ucx = start_ucx_listener(store, server.server.config, "127.0.0.1", 0, admission=admission)
    stranger = Stranger(parse_url(ucx.url), 5.0)
    keys, pages = _pages(2)
    stop = threading.Event()
    try:
        stranger.connect(None)
        progressing = threading.Thread(target=progress, args=(stranger, stop), daemon=True)
        progressing.start()
        deadline = time.monotonic() + 10
        while gate.strangers < 1:  # the listener has taken it in
            assert time.monotonic() < deadline, "the stranger was never accepted"
            time.sleep(0.01)
        with KvStoreClient(ucx.url, token=TOKEN, timeout=5.0) as client:
            assert client.put(keys, pages) == [True, True]
            assert client.exists(keys) == [True, True]
        assert gate.turned_away == 0
    finally:
        stop.set()
        if stranger._worker is not None:
            progressing.join(timeout=10)
        stranger.close()
        ucx.close()
        server.close()
        store.close()
