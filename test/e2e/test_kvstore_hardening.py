"""The store under hostile clients (issue 13, items 4 and 5): memory bounded before it is
allocated, and secure by default.

The hostile patterns run against the real server (``python -m banaserve.kvstore.server
--capacity-gb 0.25``, a subprocess) through :mod:`store_hostile`, which waits on
the server's replies and STATS counters, never on sleeps, and reads the server's peak memory
from the kernel's high-water mark. The in-process parts are ``unit/test_kvstore_admission.py``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import store_hostile as hostile
import store_hostile_patterns as patterns
from banaserve.kvstore.admission import (
    PRE_AUTH_CONTROL_BYTES,
)
from banaserve.kvstore.client import KvStoreAuthError, KvStoreClient
from banaserve.kvstore.protocol import ErrorCode
from banaserve.kvstore.server.cli import exposure_problems, is_loopback
from support.kvstore_hardening import CAPACITY, TOKEN, MiB

RSS_LIMIT = int(hostile.RSS_LIMIT_FACTOR * CAPACITY)
#: What the server may keep of a pattern once its connections are gone (allocator slack).
RELEASE_SLACK = 12 * MiB


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hostile.StoreProcess]:
    process = hostile.StoreProcess(tmp_path_factory.mktemp("hardening"), token=TOKEN)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log()


@pytest.fixture
def monitor(store: hostile.StoreProcess) -> Iterator[hostile.Monitor]:
    watcher = hostile.Monitor(store.url, TOKEN)
    try:
        yield watcher
    finally:
        watcher.close()


def assert_bounded(outcome: patterns.Outcome) -> None:
    peak, after, base = outcome.peak_rss >> 20, outcome.rss_after >> 20, outcome.baseline_rss >> 20
    what = f"{outcome.name}: peak {peak} MiB, after {after} MiB, before {base} MiB"
    assert outcome.peak_rss < RSS_LIMIT, what
    assert outcome.rss_after < RSS_LIMIT, what
    assert outcome.rss_after <= outcome.baseline_rss + RELEASE_SLACK, what


def assert_serves(url: str, tag: str) -> None:
    keys = [hostile.key(f"{tag}/{i}") for i in range(4)]
    data = [np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8) for i in range(4)]
    with KvStoreClient(url, token=TOKEN) as client:
        assert client.put(keys, data) == [True] * 4
        out = [np.zeros(4096, np.uint8) for _ in keys]
        assert client.get(keys, out) == [True] * 4
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))


# -- memory bounded before it is allocated ----------------------------------------------------


def test_unauthenticated_flood(store: hostile.StoreProcess, monitor: hostile.Monitor) -> None:
    """400 strangers, each announcing a 1 MiB control map and sending 64 KiB of it: each is
    refused (too large before HELLO, or over the connection cap) with nothing allocated."""
    outcome = patterns.run_pattern(
        store, monitor, "flood", patterns.unauthenticated_flood(store, monitor, n=400)
    )
    assert_bounded(outcome)
    codes = outcome.codes()
    assert set(codes) <= {ErrorCode.TOO_LARGE.value, ErrorCode.BUSY.value}, codes
    assert sum(codes.values()) == 400
    assert f"at most {PRE_AUTH_CONTROL_BYTES} until AUTH succeeds" in " ".join(outcome.messages())
    assert_serves(store.url, "after the flood")


def test_oversized_put_announcements(store: hostile.StoreProcess, monitor: hostile.Monitor) -> None:
    """Two authenticated PUTs announcing 1 GiB each: refused before their bodies are read."""
    outcome = patterns.run_pattern(
        store, monitor, "oversized", patterns.oversized_puts(store, monitor, n=2)
    )
    assert_bounded(outcome)
    assert outcome.codes() == {ErrorCode.TOO_LARGE.value: 2}
    (message,) = outcome.messages()
    assert "over the" in message and "max_payload" in message
    assert_serves(store.url, "after oversized PUTs")


def test_half_sent_puts(store: hostile.StoreProcess, monitor: hostile.Monitor) -> None:
    """40 connections each send half of a legal PUT and stall: as many as the in-flight budget
    holds are admitted, the others wait, then are refused BUSY; the budget comes back."""
    outcome = patterns.run_pattern(store, monitor, "half", patterns.half_sent_puts(store, monitor))
    assert_bounded(outcome)
    stats = monitor.stats()
    assert outcome.notes["settled"], outcome.notes
    admitted = outcome.notes["admitted"]
    need = outcome.notes["put_bytes"]
    assert 1 <= admitted <= stats["inflight_budget"] // need
    assert outcome.codes()[ErrorCode.BUSY.value] == 40 - admitted
    assert any(m.startswith("store busy: PUT needs") for m in outcome.messages())
    assert stats["inflight_peak"] <= stats["inflight_budget"]
    assert_serves(store.url, "after half-sent PUTs")


def test_connection_cap(store: hostile.StoreProcess, monitor: hostile.Monitor) -> None:
    """With the strangers' cap full of idle strangers, a client with the token is still
    served: the oldest strangers are closed with BUSY to make room (before issue 31's fix
    strangers shared one cap with authenticated peers and locked them out)."""
    outcome = patterns.run_pattern(store, monitor, "cap", patterns.connection_cap(store, monitor))
    assert_bounded(outcome)
    assert outcome.notes["authenticated_served"] and outcome.notes["one_closed"], outcome.notes
    closed = {code: n for code, n in outcome.codes().items() if code != "none"}
    assert set(closed) == {ErrorCode.BUSY.value} and closed[ErrorCode.BUSY.value] <= 4, closed
    assert set(outcome.messages()) == {"closed to make room: too many unauthenticated connections"}
    assert_serves(store.url, "after the cap")


# -- secure by default ------------------------------------------------------------------------


def test_tenant_tokens_isolate_keyspaces(tmp_path: Path) -> None:
    tokens = {"alpha": "alpha-token-0123456789", "beta": "beta-token-0123456789"}
    file = tmp_path / "tenants"
    file.write_text("# tenant:token\n" + "".join(f"{t}:{k}\n" for t, k in tokens.items()))
    file.chmod(0o600)
    store = hostile.StoreProcess(tmp_path, "--tenant-tokens", str(file), token=TOKEN)
    try:
        assert "auth on (shared token, 2 tenant tokens)" in store.first_line
        assert patterns.tenant_isolation(store.url, tokens, TOKEN) == []
    finally:
        store.stop()
    # Each tenant's quota is RAM of its own: quotas that leave none for the shared token's
    # keyspace are refused at start.
    code, err = hostile.refused_start("--tenant-tokens", str(file), "--tenant-quota-gb", "1",
                                      token=TOKEN)  # fmt: skip
    assert code not in (None, 0) and "--tenant-quota-gb" in err and "do not fit" in err


def test_wrong_token_is_refused(store: hostile.StoreProcess) -> None:
    with pytest.raises(KvStoreAuthError):
        KvStoreClient(store.url, token="not-" + TOKEN)


def test_no_token_off_loopback_refuses_to_start(tmp_path: Path) -> None:
    code, err = hostile.refused_start("--host", "0.0.0.0")
    assert code not in (None, 0) and "refuses to start" in err and "no token" in err
    insecure = hostile.StoreProcess(tmp_path, "--host", "0.0.0.0", "--insecure")
    try:
        assert "auth OFF" in insecure.first_line
        assert "INSECURE (--insecure): no token" in insecure.log()
    finally:
        insecure.stop()


def test_ucx_beyond_host_refuses_to_start() -> None:
    code, err = hostile.refused_start("--ucx-port", "0", token=TOKEN)
    assert code not in (None, 0) and "ucx:// cannot bind '127.0.0.1'" in err
    assert exposure_problems("0.0.0.0", True, True) == []
    assert len(exposure_problems("0.0.0.0", False, True)) == 1
    assert exposure_problems("127.0.0.1", False, False) == []
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("0.0.0.0")


def test_listeners_bind_the_configured_host(store: hostile.StoreProcess, tmp_path: Path) -> None:
    assert hostile.listening(store.pid) == [("127.0.0.1", store.port)]
    address = hostile.local_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    other = hostile.StoreProcess(tmp_path, "--host", address, token=TOKEN)
    try:
        assert hostile.listening(other.pid) == [(address, other.port)]
        with pytest.raises(OSError):  # not reachable through loopback
            socket.create_connection(("127.0.0.1", other.port), timeout=5).close()
    finally:
        other.stop()


def test_ucx_listens_where_host_says(tmp_path: Path) -> None:
    pytest.importorskip("ucxx")
    process = hostile.StoreProcess(
        tmp_path, "--host", "0.0.0.0", "--ucx-port", "0", token=TOKEN,
        env={"UCX_WARN_UNUSED_ENV_VARS": "n"},
    )  # fmt: skip
    try:
        ucx_port = int(process.first_line.split("ucx://")[1].split(")")[0].rsplit(":", 1)[1])
        bound = dict((port, host) for host, port in hostile.listening(process.pid))
        assert bound[process.port] == "0.0.0.0" and bound[ucx_port] == "0.0.0.0"
    finally:
        process.stop()


def test_embedded_store_still_starts(tmp_path: Path) -> None:
    from banaserve.kvstore.embedded import start_embedded_store

    process, url, token = start_embedded_store(0.25, None, tmp_path)
    try:
        assert url.startswith("shm://127.0.0.1:") and len(token) >= 32
        with KvStoreClient(url, token=token) as client:
            assert client.put([hostile.key("embedded")], [bytes(64)]) == [True]
        with pytest.raises(KvStoreAuthError):
            KvStoreClient(url, token=None)
    finally:
        process.stop()


def test_stats_reports_the_bounds(store: hostile.StoreProcess, monitor: hostile.Monitor) -> None:
    stats = monitor.stats()
    assert stats["max_connections"] == 256 and stats["inflight_budget"] == CAPACITY // 4
    assert stats["max_payload"] == CAPACITY // 16 - MiB  # a request's share less a control map
    assert stats["auth"] is True and stats["insecure"] is False
