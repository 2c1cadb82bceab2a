"""The hostile patterns of issue 13 against a real store server process, and what they did to
it: what ``test/e2e/test_kvstore_hardening.py`` asserts on and ``benchmark/store_probes.py``
reports.

Each pattern speaks the raw protocol on plain sockets (no well-behaved client sends what they
send) and ends on the server's replies and its own STATS counters, never on a sleep.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from banaserve.kvstore.protocol import HEADER, Op
from store_hostile import (
    PATTERN_TIMEOUT_S,
    Monitor,
    Peer,
    StoreProcess,
    close_all,
    connect,
    header,
    key,
    peak_rss,
    pump_until,
    put_head,
    reset_peak_rss,
    rss,
)


@dataclass
class Outcome:
    """What one hostile pattern did to the server: per hostile connection, the ERROR it got
    (None: none), and the server's resident memory before, at its peak during, and after."""

    name: str
    errors: list[dict[str, Any] | None]
    baseline_rss: int
    peak_rss: int
    rss_after: int
    notes: dict[str, Any] = field(default_factory=dict)

    def codes(self) -> Counter[str]:
        return Counter(e["code"] if e is not None else "none" for e in self.errors)

    def messages(self) -> set[str]:
        return {e["message"] for e in self.errors if e is not None}


def run_pattern(
    store: StoreProcess,
    monitor: Monitor,
    name: str,
    attack: Callable[[], tuple[list[Peer], dict[str, Any]]],
) -> Outcome:
    """Run ``attack`` (it opens the hostile connections and returns them once the server has
    reacted to all of them), then close them and wait until the server holds none of them."""
    baseline = rss(store.pid)
    reset_peak_rss(store.pid)
    peers: list[Peer] = []
    try:
        peers, notes = attack()
        peak = peak_rss(store.pid)
        errors = [p.error for p in peers]
    finally:
        close_all(peers)
    # Only the monitor left, holding nothing but its own STATS request (a 1-byte control map).
    monitor.wait_until(
        lambda s: s["connections"] == 1 and s.get("inflight_bytes", 0) <= 1,
        f"{name}: every hostile connection gone and its budget back",
    )
    return Outcome(name, errors, baseline, peak, rss(store.pid), notes)


def _answered(peers: list[Peer]) -> Callable[[], bool]:
    return lambda: all(p.error is not None or p.closed for p in peers)


def unauthenticated_flood(
    store: StoreProcess, monitor: Monitor, n: int = 400, announce: int = 1 << 20,
    send: int = 64 << 10,
) -> Callable[[], tuple[list[Peer], dict[str, Any]]]:  # fmt: skip
    """``n`` connections that never authenticate, each announcing a control map of ``announce``
    bytes and sending ``send`` of them."""

    def attack() -> tuple[list[Peer], dict[str, Any]]:
        head = header(Op.HELLO, announce, 0)
        before = monitor.stats().get("accepted")
        peers = [Peer(connect(store.host, store.port), head + bytes(send)) for _ in range(n)]
        if before is None:  # a server without the counter: all of them open, and the monitor
            monitor.wait_until(lambda s: s["connections"] >= n + 1, f"{n} strangers accepted")
        else:
            monitor.wait_until(lambda s: s["accepted"] >= before + n, f"{n} strangers accepted")
        answered = pump_until(peers, _answered(peers), PATTERN_TIMEOUT_S)
        return peers, {"all_answered": answered}

    return attack


def oversized_puts(
    store: StoreProcess, monitor: Monitor, n: int = 2, announce: int = 1 << 30,
    send: int = 1 << 20,
) -> Callable[[], tuple[list[Peer], dict[str, Any]]]:  # fmt: skip
    """``n`` authenticated connections, each announcing a PUT of ``announce`` bytes and sending
    ``send`` of them."""

    def attack() -> tuple[list[Peer], dict[str, Any]]:
        peers = [
            Peer(connect(store.host, store.port, store.token),
                 put_head([key(f"oversized {i}")], [announce]) + bytes(send))
            for i in range(n)
        ]  # fmt: skip
        answered = pump_until(peers, _answered(peers), 10.0)
        return peers, {"all_answered": answered}

    return attack


def half_sent_puts(
    store: StoreProcess, monitor: Monitor, n: int = 40, size: int | None = None
) -> Callable[[], tuple[list[Peer], dict[str, Any]]]:
    """``n`` authenticated connections, each sending half of a legal PUT (``size`` bytes: the
    server's max_payload, at most 15 MiB) and then nothing. Ends once every connection is either
    refused or admitted: holding its share of the in-flight budget, as STATS counts."""

    def attack() -> tuple[list[Peer], dict[str, Any]]:
        nbytes = size or min(monitor.stats()["max_payload"], 15 << 20)
        heads = [put_head([key(f"half {i}")], [nbytes]) for i in range(n)]
        need = len(heads[0]) - HEADER.size + nbytes  # control map and payload
        peers = [
            Peer(connect(store.host, store.port, store.token), h + bytes(nbytes // 2))
            for h in heads
        ]
        admitted = 0

        def settled() -> bool:
            nonlocal admitted
            admitted = monitor.stats().get("inflight_bytes", 0) // need
            return sum(p.error is not None or p.closed for p in peers) + admitted >= n

        done = pump_until(peers, settled, 20.0)
        return peers, {"settled": done, "admitted": admitted, "put_bytes": nbytes}

    return attack


def connection_cap(
    store: StoreProcess, monitor: Monitor
) -> Callable[[], tuple[list[Peer], dict[str, Any]]]:
    """Fill the strangers' connection cap with idle strangers (the hostile connections of
    the outcome), then connect with the token: the client must be served
    (``authenticated_served``), the oldest strangers closed with BUSY to make room for it."""
    from banaserve.kvstore.client import KvStoreClient

    def attack() -> tuple[list[Peer], dict[str, Any]]:
        # Nothing but the monitor open, so that no slot frees up while the cap is full.
        stats = monitor.wait_until(lambda s: s["connections"] == 1, "only the monitor open")
        limit = stats["max_strangers"]
        idle = [Peer(connect(store.host, store.port), b"") for _ in range(limit)]
        monitor.wait_until(lambda s: s["unauthenticated"] >= limit, f"{limit} strangers in")
        with KvStoreClient(store.url, token=store.token) as client:
            served = client.exists([key("cap probe")]) == [False]
            served = served and "error" not in client.stats()[store.url]
        closed = pump_until(idle, lambda: any(p.error is not None for p in idle), 10.0)
        return idle, {"limit": limit, "authenticated_served": served, "one_closed": closed}

    return attack


def tenant_isolation(url: str, tokens: dict[str, str], shared: str | None) -> list[str]:
    """What per-tenant tokens fail to isolate on the store at ``url`` (empty: nothing). Needs
    two tenants in ``tokens``; ``shared``: the shared token, if the store has one."""
    from banaserve.kvstore.client import KvStoreAuthError, KvStoreClient

    (alpha, alpha_token), (beta, beta_token), *_ = tokens.items()
    raw = [key("the same raw key"), key(f"only {beta} has this")]
    pages = [bytes([i]) * 4096 for i in (1, 2, 3)]
    problems = []
    with (
        KvStoreClient(url, token=alpha_token) as a,
        KvStoreClient(url, token=beta_token) as b,
    ):
        a.put(raw[:1], pages[:1])
        b.put(raw, pages[1:])
        for client, name, want in ((a, alpha, pages[0]), (b, beta, pages[1])):
            out = bytearray(4096)
            if client.get(raw[:1], [out]) != [True] or bytes(out) != want:
                problems.append(f"{name} does not read back its own page under a shared raw key")
        if a.exists(raw[1:]) != [False] or a.get(raw[1:], [bytearray(4096)]) != [False]:
            problems.append(f"{alpha} can probe or read a page only {beta} stored")
        # STATS tells a tenant of its own requests (alpha: 1 PUT page, 2 GET pages, 1 hit) and
        # of its own store (its quota: 1 page, 1 put), nothing of beta's.
        (shown,) = a.stats().values()
        server = {**shown.get("server", {}), "tenant": alpha, "put_pages": 1, "put_stored": 1,
                  "get_pages": 2, "get_hits": 1}  # fmt: skip
        store = (shown.get("ram_pages"), shown.get("puts"))
        if shown.get("server") != server or "pid" in server or store != (1, 1):
            problems.append(f"{alpha}'s STATS tells more than its own: {shown}")
    if shared is not None:
        with KvStoreClient(url, token=shared) as s:
            if s.exists(raw) != [False, False]:
                problems.append("the shared keyspace sees tenant pages under their raw keys")
    try:
        KvStoreClient(url, token=f"not-{alpha_token}").close()
        problems.append("a wrong token was accepted")
    except KvStoreAuthError:
        pass
    return problems
