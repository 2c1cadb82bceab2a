"""Whole-instance role moves: when one role is overloaded and the other has capacity to spare,
an instance changes role.

The cluster's pressure is the peak *utilisation* over the two roles: the outstanding requests
of a role (queued and running on its instances, with the router's in-flight work merged in)
over the cores its instances run on, in units of what one core serves at full speed
(``decode_full_reqs`` decodes, ``prefill_full_reqs`` prefills). The controller makes the single
move that lowers that peak most, if it lowers it by at least ``min_gain``: with one decode
instance holding every long request while the prefill cores idle, a prefill instance on a core
of its own becomes a decode instance; when prompts pile up on the prefill side, it goes back.

Against flapping: demand is smoothed over ticks, a move must cut the peak by a margin, an
instance stays in a role it was moved to for ``dwell_s``, and two moves are ``cooldown_s``
apart. Each role keeps at least ``min_per_role`` healthy instances (the knobs are
:class:`RoleControllerConfig`'s).

Cores are counted, not instances, because instances share cores: in the 2P+1D layout on two
cores, the decode instance and the first prefill instance share core 0, so moving that
prefill instance to decode adds no decode capacity, and the controller does not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from banaserve.router.base import Role
from banaserve.router.load import InstanceLoad

ROLES = (Role.PREFILL, Role.DECODE)


@dataclass(frozen=True)
class RoleControllerConfig:
    """The controller's knobs; every default is here."""

    #: Decoding requests one core serves before each one's time per token grows much.
    decode_full_reqs: float = 4.0
    #: Prefill steps one core computes at once (a CPU core is busy with one).
    prefill_full_reqs: float = 1.0
    #: Below this peak utilisation nothing moves: an idle cluster stays as it was started.
    min_peak: float = 0.5
    #: A move must cut the peak utilisation by at least this fraction.
    min_gain: float = 0.25
    #: Seconds an instance stays in a role it was moved to before it may move again.
    dwell_s: float = 10.0
    #: Seconds between two moves of the cluster.
    cooldown_s: float = 2.0
    #: Weight of the newest demand sample in the smoothed demand (1: no smoothing).
    smoothing: float = 0.5
    #: Healthy instances each role keeps.
    min_per_role: int = 1

    def __post_init__(self) -> None:
        if min(self.decode_full_reqs, self.prefill_full_reqs) <= 0:
            raise ValueError("decode_full_reqs and prefill_full_reqs must be positive")
        if not 0 < self.smoothing <= 1 or not 0 <= self.min_gain < 1:
            raise ValueError("smoothing must be in (0, 1] and min_gain in [0, 1)")
        if min(self.dwell_s, self.cooldown_s, self.min_peak) < 0 or self.min_per_role < 1:
            raise ValueError("dwell_s, cooldown_s and min_peak must not be negative, "
                             "min_per_role at least 1")  # fmt: skip

    def full_reqs(self, role: Role) -> float:
        return self.decode_full_reqs if role == Role.DECODE else self.prefill_full_reqs


@dataclass(frozen=True)
class RoleMove:
    """One instance changing role at ``at`` (the controller's clock)."""

    url: str
    from_role: Role
    to_role: Role
    at: float
    #: Peak utilisation before and (as predicted) after the move.
    peak_before: float
    peak_after: float
    reason: str = "controller"
    #: A role move copies nothing: roles are routing labels.
    bytes_moved: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "url": self.url, "from": str(self.from_role), "to": str(self.to_role),
            "at": round(self.at, 3), "peak_before": round(self.peak_before, 3),
            "peak_after": round(self.peak_after, 3), "reason": self.reason,
            "bytes_moved": self.bytes_moved,
        }  # fmt: skip


@dataclass
class RoleController:
    """Decides role moves from load records.

    Contract: :meth:`step` is a function of the records, ``now`` and the controller's own
    state (smoothed demand, when each instance last moved): no I/O, no clock but ``now``, so
    the gateway, tests and a simulator run the same decisions. Not locked: one caller at a
    time. ``cores`` maps an instance's url to the cores it runs on (an instance missing from it
    counts as a core of its own); ``home`` to the role it was started in, which a move back
    prefers.
    """

    config: RoleControllerConfig = field(default_factory=RoleControllerConfig)
    cores: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    home: Mapping[str, Role] = field(default_factory=dict)
    demand: dict[Role, float] = field(default_factory=lambda: dict.fromkeys(ROLES, 0.0))
    moved_at: dict[str, float] = field(default_factory=dict)
    last_move_at: float = -math.inf

    def utilisation(self, members: Mapping[Role, Sequence[str]]) -> dict[Role, float]:
        """Smoothed demand of each role over the cores of ``members`` (urls per role)."""
        out = {}
        for role in ROLES:
            cores = self._cores(members[role])
            full = cores * self.config.full_reqs(role)
            idle = 0.0 if not self.demand[role] else math.inf  # demand and no core to serve it
            out[role] = self.demand[role] / full if full else idle
        return out

    def step(self, loads: Sequence[InstanceLoad], now: float) -> list[RoleMove]:
        """The moves to make now (at most one), given every instance's record (its current
        role in ``role``)."""
        healthy = [load for load in loads if load.healthy and load.role in ROLES]
        members = {role: [c.url for c in healthy if c.role == role] for role in ROLES}
        alpha = self.config.smoothing
        for role in ROLES:
            sample = sum(c.batch_reqs for c in healthy if c.role == role)
            self.demand[role] = alpha * sample + (1 - alpha) * self.demand[role]
        peak = max(self.utilisation(members).values())
        if peak < self.config.min_peak or now - self.last_move_at < self.config.cooldown_s:
            return []
        best: tuple[float, InstanceLoad, Role] | None = None
        for source, target in ((Role.PREFILL, Role.DECODE), (Role.DECODE, Role.PREFILL)):
            if len(members[source]) <= self.config.min_per_role:
                continue
            for load in sorted(
                (c for c in healthy if c.role == source and self._may_move(c.url, now)),
                key=lambda c: (c.batch_reqs, self.home.get(c.url) != target, c.url),
            ):
                after = {role: list(urls) for role, urls in members.items()}
                after[source].remove(load.url)
                after[target].append(load.url)
                peak_after = max(self.utilisation(after).values())
                if best is None or peak_after < best[0]:
                    best = (peak_after, load, target)
        if best is None or best[0] > peak * (1 - self.config.min_gain):
            return []
        peak_after, load, target = best
        self.moved_at[load.url] = self.last_move_at = now
        return [RoleMove(load.url, Role(load.role), target, now, peak, peak_after)]

    def moved(self, url: str, now: float) -> None:
        """An instance was moved by hand (the admin API): it dwells like a controller move."""
        self.moved_at[url] = self.last_move_at = now

    def _may_move(self, url: str, now: float) -> bool:
        return now - self.moved_at.get(url, -math.inf) >= self.config.dwell_s

    def _cores(self, urls: Sequence[str]) -> int:
        cores: set[object] = set()
        for url in urls:
            cores.update(self.cores.get(url) or (url,))
        return len(cores)
