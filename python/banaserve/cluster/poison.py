"""Poison pills: requests that kill the instances serving them.

A request is known by the digest of its path and decoded body, what it asks and not its
bytes (:func:`banaserve.cluster.intake.body_digest`). Each time an instance dies while
serving it, :meth:`PoisonGuard.died_serving` counts one more death against that digest,
whichever request carried it (a client resending the same body counts too, however spaced).
What the gateway does then (:meth:`PoisonGuard.after_death`):

- an instance that crashed by itself (it exited, no signal from outside) may have been
  killed by this very request, so the request is retried once, on that same instance once
  it has been restarted: nothing else is put at risk, and an innocent request (one that
  happened to share a batch with the culprit) is still served;
- an instance killed from outside (SIGKILL from the OOM killer or an operator) says nothing
  against the request: it is retried once on another instance at once;
- at the second death the request is answered 500 and its digest is quarantined for
  :attr:`PoisonGuard.quarantine_s`: the same body is refused at once meanwhile.

So a request that crashes its instance never reaches another one, and one whose
instance was killed from outside is tried on one other instance at most.

Pure code with an injected clock; used from the gateway's event loop (no lock).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Deaths that quarantine a digest, and for how long (the defaults of PoisonGuard).
DEATHS_TO_QUARANTINE = 2
QUARANTINE_S = 600.0
#: A digest's deaths are forgotten this long after the last one (bounds the table's size).
MEMORY_S = 3600.0
MAX_DIGESTS = 10_000


class Retry(enum.Enum):
    """What to do with a request whose instance died while serving it."""

    SAME_INSTANCE = "same_instance"  # once it has been restarted
    ELSEWHERE = "elsewhere"
    QUARANTINE = "quarantine"  # answer 500; refuse the body for a while


@dataclass
class _Record:
    deaths: int
    last_at: float
    quarantined_until: float = 0.0


class PoisonGuard:
    """Death counts per request digest, and the quarantine they lead to.

    Owns its table of digests, bounded by :data:`MAX_DIGESTS` and :data:`MEMORY_S`. Confined
    to the gateway's event loop (no lock); nothing blocks; time comes from ``clock``.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        deaths_to_quarantine: int = DEATHS_TO_QUARANTINE,
        quarantine_s: float = QUARANTINE_S,
    ) -> None:
        self.clock = clock
        self.deaths_to_quarantine = deaths_to_quarantine
        self.quarantine_s = quarantine_s
        self._records: dict[str, _Record] = {}
        self.quarantined = 0  # digests put in quarantine (a counter for /metrics)
        self.refused = 0  # requests refused because their digest was in quarantine

    def refusal(self, digest: str) -> str | None:
        """Why ``digest`` is refused now, or None if it may be served."""
        record = self._records.get(digest)
        now = self.clock()
        if record is None or record.quarantined_until <= now:
            return None
        self.refused += 1
        return (
            f"An identical request crashed {record.deaths} instances of this cluster; it is "
            f"refused for another {record.quarantined_until - now:.0f} s."
        )

    def died_serving(self, digest: str) -> int:
        """Count one instance death against ``digest``; return its deaths so far."""
        now = self.clock()
        self._forget_old(now)
        record = self._records.get(digest)
        if record is None:
            record = self._records[digest] = _Record(0, now)
        record.deaths += 1
        record.last_at = now
        if record.deaths >= self.deaths_to_quarantine:
            if record.quarantined_until <= now:
                self.quarantined += 1
            record.quarantined_until = now + self.quarantine_s
        return record.deaths

    def after_death(self, digest: str, crashed_by_itself: bool) -> Retry:
        """Count the death (see :meth:`died_serving`) and say what to do with the request."""
        if self.died_serving(digest) >= self.deaths_to_quarantine:
            return Retry.QUARANTINE
        return Retry.SAME_INSTANCE if crashed_by_itself else Retry.ELSEWHERE

    def _forget_old(self, now: float) -> None:
        if len(self._records) < MAX_DIGESTS:
            return
        for digest in [d for d, r in self._records.items()
                       if now - r.last_at > MEMORY_S and r.quarantined_until <= now]:  # fmt: skip
            del self._records[digest]
        while len(self._records) >= MAX_DIGESTS:  # still full: drop the oldest
            del self._records[min(self._records, key=lambda d: self._records[d].last_at)]
