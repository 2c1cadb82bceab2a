"""In-flight claims on page keys: who is computing a missing page right now, and who waits.

"No prefix computed twice in the cluster": an instance that finds pages missing and starts
computing them *claims* their keys (a LOOKUP with ``claim``); another lookup of a claimed key
that is not yet stored *waits* for it instead of computing it again, and loads it once it is
PUT. A claim ends when

* the key is stored (a PUT from anyone): waiters find it present, a computation saved;
* its owner releases it (RELEASE), or the connection that made it closes (its process died or
  its client closed): a crashed instance never holds others up beyond a moment;
* its lease runs out (checked lazily: by a waiter waking at the expiry, or by a lookup).

Claims live in the server's memory only (a restarted server has none: lookups then just miss).
The table is bounded (``max_claims`` keys); when full, expired claims are purged and, if it is
still full, further keys go unclaimed (their lookups report them missing, unclaimed: the caller
computes them anyway, without coalescing).

Not thread-safe: a :class:`ClaimTable` belongs to one asyncio event loop and every method runs
on it (the server calls it from its connection tasks; other threads hand it work through
``loop.call_soon_threadsafe``). Waiting (:meth:`ClaimTable.wait`) suspends only the waiting
task, never the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

#: About what one claimed key costs the server, in bytes (key, claim, table entry).
CLAIM_BYTES = 150
#: Keys the table holds at most (CLAIM_BYTES each: about 150 MiB at this bound).
DEFAULT_MAX_CLAIMS = 1 << 20
#: Seconds between full sweeps for expired claims while the table is full.
_SWEEP_INTERVAL_S = 1.0


@dataclass(eq=False)
class Claim:
    """One key being computed by ``owner``; ``holder`` is the connection that made (or last
    renewed) it. Mutable: a renewal extends ``expires`` in place, so waiters keep their event."""

    key: bytes
    owner: str
    holder: Hashable
    expires: float
    done: bool = False
    _event: asyncio.Event | None = field(default=None, repr=False)

    def event(self) -> asyncio.Event:
        """Set when the claim ends; made on first use (most claims are never waited on)."""
        if self._event is None:
            self._event = asyncio.Event()
            if self.done:
                self._event.set()
        return self._event


class ClaimTable:
    """Claims by key, with leases, per-connection ownership and waiters. See the module doc.

    ``clock`` gives the time leases and deadlines are measured in (monotonic seconds).
    Counters: ``expired`` (claims that ran out their lease before being stored or released).
    """

    def __init__(
        self,
        max_claims: int = DEFAULT_MAX_CLAIMS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_claims <= 0:
            raise ValueError(f"max_claims must be positive, got {max_claims}")
        self.max_claims = max_claims
        self.clock = clock
        self.expired = 0
        self._claims: dict[bytes, Claim] = {}
        self._by_holder: dict[Hashable, set[bytes]] = {}
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._claims)

    def holder(self, key: bytes) -> Claim | None:
        """The valid claim on ``key``, or None (an expired one is ended here, lazily)."""
        claim = self._claims.get(key)
        if claim is not None and claim.expires <= self.clock():
            self.expired += 1
            self._end(claim)
            return None
        return claim

    def claim(
        self, key: bytes, owner: str, holder: Hashable, lease_s: float, *, force: bool = False
    ) -> bool:
        """Claim ``key`` for ``owner`` until ``lease_s`` from now, tied to connection ``holder``.

        True if ``owner`` now holds it: it was free, already ``owner``'s (renewed, and moved
        to ``holder``), or ``force`` (taken over from another owner; its waiters keep waiting,
        now on this claim). False if another owner validly holds it, or the table is full.
        """
        now = self.clock()
        claim = self.holder(key)
        if claim is not None and claim.owner != owner and not force:
            return False
        if claim is None:
            if len(self._claims) >= self.max_claims and not self._sweep(now):
                return False
            claim = Claim(key, owner, holder, now + lease_s)
            self._claims[key] = claim
        else:
            self._unlink_holder(claim)
            claim.owner, claim.holder, claim.expires = owner, holder, now + lease_s
        self._by_holder.setdefault(holder, set()).add(key)
        return True

    def stored(self, keys: Iterable[bytes]) -> None:
        """Keys just stored (by anyone): their claims end and their waiters wake."""
        for key in keys:
            claim = self._claims.get(key)
            if claim is not None:
                self._end(claim)

    def release(self, key: bytes, owner: str) -> bool:
        """End ``owner``'s claim on ``key``; False if ``owner`` does not hold it."""
        claim = self.holder(key)
        if claim is None or claim.owner != owner:
            return False
        self._end(claim)
        return True

    def drop_holder(self, holder: Hashable) -> int:
        """The connection ``holder`` closed: end every claim it made; returns how many."""
        keys = self._by_holder.pop(holder, set())
        for key in keys:
            claim = self._claims.get(key)
            if claim is not None and claim.holder is holder:
                self._end(claim)
        return len(keys)

    def clear(self) -> int:
        """End every claim (the store was cleared), waking every waiter; returns how many."""
        claims = list(self._claims.values())
        for claim in claims:
            self._end(claim)
        return len(claims)

    async def wait(self, claim: Claim, deadline: float) -> None:
        """Suspend until ``claim`` ends, its lease runs out, or ``deadline`` (clock time),
        whichever comes first. The caller then looks again (store, then :meth:`holder`)."""
        timeout = min(deadline, claim.expires) - self.clock()
        if claim.done or timeout <= 0:
            return
        try:
            await asyncio.wait_for(claim.event().wait(), timeout)
        except TimeoutError:
            pass

    # -- internals --------------------------------------------------------------------------

    def _end(self, claim: Claim) -> None:
        if self._claims.get(claim.key) is claim:
            del self._claims[claim.key]
        self._unlink_holder(claim)
        claim.done = True
        if claim._event is not None:
            claim._event.set()

    def _unlink_holder(self, claim: Claim) -> None:
        keys = self._by_holder.get(claim.holder)
        if keys is not None:
            keys.discard(claim.key)
            if not keys:
                del self._by_holder[claim.holder]

    def _sweep(self, now: float) -> bool:
        """End expired claims (at most once per interval: a sweep is O(table)); True if there
        is room now."""
        if now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_INTERVAL_S
            for claim in [c for c in self._claims.values() if c.expires <= now]:
                self.expired += 1
                self._end(claim)
        return len(self._claims) < self.max_claims
