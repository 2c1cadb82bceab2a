"""LOOKUP over a claim table: wait for keys that others are computing, then claim the
missing tail (the protocol is :class:`~banaserve.kvstore.protocol.Op`'s; the table is
:mod:`banaserve.kvstore.claims`).

Runs on the TCP server's event loop, in the task of the connection that asked; waiting
suspends only that task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from banaserve.kvstore.claims import ClaimTable

#: ``contains(keys)``: whether each key is stored (the server runs it on its store threads).
Contains = Callable[[list[bytes]], Awaitable[list[bool]]]


class Waiter(Protocol):
    """The connection a LOOKUP came on: it holds the claims the LOOKUP takes."""

    #: Seen closed by its peer while the LOOKUP waited.
    gone: bool

    def watch_eof(self, on_gone: Callable[[], None]) -> Callable[[], None]:
        """Set :attr:`gone` and call ``on_gone`` once the peer closes; returns the undo."""
        ...


async def serve_lookup(
    claims: ClaimTable,
    counters: dict[str, int],
    contains: Contains,
    conn: Waiter,
    control: dict[str, Any],
) -> dict[str, Any]:
    """The LOOKUP reply for ``control`` (validated, keys already mapped), with claims tied to
    ``conn``; updates the server's ``counters``.

    One store call for the whole batch in the common case, one more per key waited on.
    A claim is looked at *before* the store is asked, so a PUT landing in between is
    seen either as the key present or as the claim ended (never as neither): a waiter
    cannot miss a page that was stored while it looked.
    """
    keys: list[bytes] = control["keys"]
    owner: str = control["owner"]
    deadline = claims.clock() + control["wait_ms"] / 1000
    held = [claims.holder(key) for key in keys]
    present = await contains(keys)
    first_miss, timed_out = len(keys), False
    unwatch: Callable[[], None] | None = None
    try:
        for i, key in enumerate(keys):
            claim = held[i]
            while not present[i] and claim is not None and claim.owner != owner:
                if claims.clock() >= deadline or conn.gone:
                    # A LOOKUP that asked for no wait ran out of nothing: it takes over nothing.
                    timed_out = not conn.gone and control["wait_ms"] > 0
                    break
                if unwatch is None:
                    counters["claim_waits"] += 1
                    # On EOF end this connection's claims at once, so their waiters stop.
                    unwatch = conn.watch_eof(lambda: claims.drop_holder(conn))
                await claims.wait(claim, deadline)
                claim = claims.holder(key)
                (present[i],) = await contains([key])
                counters["coalesced"] += present[i]
            if not present[i]:
                first_miss = i
                break
    finally:
        if unwatch is not None:
            unwatch()
    counters["wait_timeouts"] += timed_out
    claimed = [False] * len(keys)
    if control["claim"] and not conn.gone:
        lease_s = control["lease_ms"] / 1000
        for j in range(first_miss, len(keys)):
            if not present[j]:
                # After a wait that ran out, take over: this caller computes the tail now,
                # and the owner it waited for has not delivered in time.
                claimed[j] = claims.claim(keys[j], owner, conn, lease_s, force=timed_out)
        counters["claims"] += sum(claimed)
    return {"present": present, "claimed": claimed}
