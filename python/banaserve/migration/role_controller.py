"""Whole-instance role moves: when one kind of work is overloaded and the other has capacity
to spare, an instance changes role.

An instance serves as ``prefill`` (prefill steps of handoffs, and short requests), ``decode``
(serve steps) or ``mixed`` (both: a prefill instance that takes long decodes too, or a decode
instance that takes prefill steps). The cluster's pressure is the peak *utilisation* over the
two kinds of work: the outstanding requests of each (queued and running, with the router's
in-flight work merged in; on a decode or mixed instance its queued prompt tokens, in units
of ``prefill_unit_tokens``, count as prefill work and the rest as decode work) over the cores
that serve it, in units of what one core serves at full speed (``decode_full_reqs`` decodes,
``prefill_full_reqs`` prefills). A core counts whole for a kind of work when an instance of that
role runs on it, half when only a mixed one does. The controller makes the single move that
lowers the peak most, if it lowers it by at least ``min_gain``. With one decode instance holding
every long request while the prefill cores idle, a prefill instance on a core of its own
becomes a decode instance (or, where it is the only prefill instance, a mixed one); when prompts
pile up, it goes back.

Against flapping: demand is smoothed over ticks, a move must cut the peak by a margin, an
instance stays in a role it was moved to for ``dwell_s``, and two moves are ``cooldown_s``
apart. Prefill steps and serve steps each keep at least ``min_per_role`` healthy instances
that take them (the knobs are :class:`RoleControllerConfig`'s).

Cores are counted, not instances, because instances share cores: in the 2P+1D layout on two
cores, the decode instance and the first prefill instance share core 0, so moving that
prefill instance to decode adds no decode capacity, and the controller does not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from banaserve.migration.work import (
    DECODE_FULL_REQS,
    PREFILL_FULL_REQS,
    PREFILL_UNIT_TOKENS,
    work_of,
)
from banaserve.router.base import Role
from banaserve.router.load import InstanceLoad

#: The roles an instance can be moved between.
ROLES = (Role.PREFILL, Role.DECODE, Role.MIXED)
#: The two kinds of work, and the roles whose instances take each.
WORK = (Role.PREFILL, Role.DECODE)
TAKES = {Role.PREFILL: (Role.PREFILL, Role.MIXED), Role.DECODE: (Role.DECODE, Role.MIXED)}


@dataclass(frozen=True)
class RoleControllerConfig:
    """The controller's knobs; every default is here."""

    #: Decoding requests one core serves at full speed (see :mod:`banaserve.migration.work`).
    decode_full_reqs: float = DECODE_FULL_REQS
    #: Prefill steps one core computes at once.
    prefill_full_reqs: float = PREFILL_FULL_REQS
    #: Queued prompt tokens on a decode or mixed instance that count as one prefill step.
    prefill_unit_tokens: int = PREFILL_UNIT_TOKENS
    #: Below this peak utilisation nothing moves: an idle cluster stays as it was started.
    #: One core's worth of work: at 0.5 the controller moved on a benchmark's warm-up
    #: request. Smoothed demand only approaches a constant load, so one lone request (1.0 at
    #: ``decode_full_reqs`` 1) never moves anything; a second one does.
    min_peak: float = 1.0
    #: A move must cut the peak utilisation by at least this fraction.
    min_gain: float = 0.25
    #: Seconds an instance stays in a role it was moved to before it may move again. Long
    #: enough to span a few long requests: with 10 s, a load whose prompts and decodes
    #: alternate (uniform_long) moved one instance 6 times in 200 s.
    dwell_s: float = 30.0
    #: Seconds between two moves of the cluster.
    cooldown_s: float = 2.0
    #: Weight of the newest demand sample in the smoothed demand (1: no smoothing).
    smoothing: float = 0.5
    #: Healthy instances each role keeps.
    min_per_role: int = 1

    def __post_init__(self) -> None:
        if min(self.decode_full_reqs, self.prefill_full_reqs, self.prefill_unit_tokens) <= 0:
            raise ValueError(
                "decode_full_reqs, prefill_full_reqs and prefill_unit_tokens must be positive"
            )
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
    demand: dict[Role, float] = field(default_factory=lambda: dict.fromkeys(WORK, 0.0))
    moved_at: dict[str, float] = field(default_factory=dict)
    last_move_at: float = -math.inf

    def utilisation(self, roles: Mapping[str, Role]) -> dict[Role, float]:
        """Smoothed demand of each kind of work over the cores that serve it, with the
        healthy instances in ``roles`` (url -> role)."""
        capacity = self._capacity(roles)
        out = {}
        for work in WORK:
            full = capacity[work] * self.config.full_reqs(work)
            idle = 0.0 if not self.demand[work] else math.inf  # work and no core to serve it
            out[work] = self.demand[work] / full if full else idle
        return out

    def step(self, loads: Sequence[InstanceLoad], now: float) -> list[RoleMove]:
        """The moves to make now (at most one), given every instance's record (its current
        role in ``role``)."""
        healthy = [load for load in loads if load.healthy and load.role in ROLES]
        roles = {c.url: Role(c.role) for c in healthy}
        alpha = self.config.smoothing
        samples = dict.fromkeys(WORK, 0.0)
        for load in healthy:
            for work, amount in work_of(load, self.config.prefill_unit_tokens).items():
                samples[work] += amount
        for work in WORK:
            self.demand[work] = alpha * samples[work] + (1 - alpha) * self.demand[work]
        peak = max(self.utilisation(roles).values())
        if peak <= self.config.min_peak or now - self.last_move_at < self.config.cooldown_s:
            return []
        best: tuple[tuple[float, bool, int, str], InstanceLoad, Role] | None = None
        for load in healthy:
            if not self._may_move(load.url, now):
                continue
            for target in ROLES:
                after = {**roles, load.url: target}
                if target == roles[load.url] or not self.keeps_every_step(after):
                    continue
                peak_after = max(self.utilisation(after).values())
                rank = (peak_after, self.home.get(load.url) != target, load.batch_reqs, load.url)
                if best is None or rank < best[0]:
                    best = (rank, load, target)
        if best is None or best[0][0] > peak * (1 - self.config.min_gain):
            return []
        rank, load, target = best
        self.moved_at[load.url] = self.last_move_at = now
        return [RoleMove(load.url, Role(load.role), target, now, peak, rank[0])]

    def keeps_every_step(self, roles: Mapping[str, Role]) -> bool:
        """Whether each kind of work keeps ``min_per_role`` instances that take it."""
        return all(
            sum(role in TAKES[work] for role in roles.values()) >= self.config.min_per_role
            for work in WORK
        )

    def forget(self) -> None:
        """Start afresh: no smoothed demand, no instance dwelling."""
        self.demand = dict.fromkeys(WORK, 0.0)
        self.moved_at.clear()
        self.last_move_at = -math.inf

    def moved(self, url: str, now: float) -> None:
        """An instance was moved by hand (the admin API): it dwells like a controller move."""
        self.moved_at[url] = self.last_move_at = now

    def _may_move(self, url: str, now: float) -> bool:
        return now - self.moved_at.get(url, -math.inf) >= self.config.dwell_s

    def _capacity(self, roles: Mapping[str, Role]) -> dict[Role, float]:
        """Cores serving each kind of work: whole where an instance of that role runs on the
        core, half where only a mixed one does."""
        on_core: dict[object, set[Role]] = {}
        for url, role in roles.items():
            for core in self.cores.get(url) or (url,):
                on_core.setdefault(core, set()).add(role)
        capacity = dict.fromkeys(WORK, 0.0)
        for present in on_core.values():
            for work in WORK:
                capacity[work] += 1.0 if work in present else 0.5 if Role.MIXED in present else 0.0
        return capacity
