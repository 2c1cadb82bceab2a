"""When a dead child may be started again: exponential backoff with a cap per minute.

Pure code over the start times of a child's recent restarts, with the clock's ``now`` passed
in, so the supervisor and a test (or a simulator) decide alike.

The backoff doubles with each restart inside :attr:`RestartPolicy.calm_after_s` of the one
before (a crash loop), from :attr:`initial_backoff_s` up to :attr:`max_backoff_s`; a child
that ran calmly for that long starts again from the initial delay. On top of that, at most
:attr:`max_per_minute` restarts start in any 60 s. It never gives up: a cluster that could
restart something does, later if not now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WINDOW_S = 60.0


@dataclass(frozen=True)
class RestartPolicy:
    """The backoff and the per-minute cap of restarts (see the module docstring). Immutable
    and stateless: the caller keeps each child's restart times and passes ``now`` in."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    max_per_minute: int = 4
    calm_after_s: float = 300.0

    def __post_init__(self) -> None:
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(f"restart backoff out of range: {self}")
        if self.max_per_minute < 1:
            raise ValueError("max_per_minute must be at least 1")

    def backoff_s(self, restarts: Sequence[float], died_at: float) -> float:
        """The delay after a death at ``died_at``, from the restarts (start times, oldest
        first) of the crash loop it ends."""
        streak = 0
        previous = died_at
        for started in reversed(restarts):
            if previous - started > self.calm_after_s:
                break
            streak += 1
            previous = started
        return min(self.max_backoff_s, self.initial_backoff_s * 2**streak)

    def restart_at(self, restarts: Sequence[float], died_at: float) -> float:
        """When the next restart may start: the backoff, delayed further if the last
        minute's restarts already reach the cap."""
        at = died_at + self.backoff_s(restarts, died_at)
        recent = [t for t in restarts if at - t < WINDOW_S]
        if len(recent) >= self.max_per_minute:
            at = max(at, recent[-self.max_per_minute] + WINDOW_S)
        return at
