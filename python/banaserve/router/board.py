"""The router's view of the cluster: the latest load record per instance, and its own count of
the work it sent that has not ended.

An instance's record comes from its ``/v1/loads`` answer (read by the cluster's poller, which
hands it to :meth:`Board.record_poll`), merged with the router's in-flight counts when a policy
reads it (reports lag behind a burst by up to one poll; see
:func:`banaserve.router.load.with_inflight`). An instance whose process exited is out of
routing until :meth:`Board.revive`; one whose polls failed :data:`FAILURES_BEFORE_DOWN` times
in a row leaves routing until a later good poll.

An instance that answers its polls but whose scheduler stopped making progress (stopped with
SIGSTOP, deadlocked) would keep every request sent to it waiting: SGLang answers ``/v1/loads``
from a snapshot in shared memory, without the scheduler. The scheduler publishes a new
snapshot after every prefill batch and decode step (``published_at`` changes), so one that
holds requests, by its own report or the router's count, and has published nothing for
``stall_after_s`` has stalled: it leaves routing, and its requests waiting on it are woken
(to be retried elsewhere). It stays out until something proves progress: a new snapshot, or
a health probe that got a token through it (:meth:`Board.unstalled`, the poller's).

An instance's role starts as its spec's and is a routing label: :meth:`Board.set_role` moves a
whole instance to the other role (the migration controller's coarsest move); its requests in
flight finish where they are.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from banaserve.router.base import Role
from banaserve.router.load import InstanceLoad, with_inflight
from banaserve.router.loads_report import load_from_loads

logger = logging.getLogger("banaserve.router")

#: Failed polls in a row after which an instance leaves routing.
FAILURES_BEFORE_DOWN = 3
#: Seconds an instance may hold requests without publishing progress before it counts as
#: stalled (the ``--stall-timeout`` default). SGLang publishes after every prefill batch and
#: decode step, so it only has to exceed the longest single batch a deployment runs; not
#: measured against one: a judgement, and a flag to raise where one prefill batch is slower.
STALL_AFTER_S = 10.0


class Member(Protocol):
    """What the board needs to know of an instance (the cluster's ``InstanceSpec`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def url(self) -> str: ...


@dataclass
class _Inflight:
    requests: int = 0
    prefill_tokens: int = 0
    handoff_tokens: int = 0  # of prefill_tokens, those of handoffs' prefill steps
    decode_tokens: int = 0  # the most output tokens its requests may still generate


@dataclass
class InstanceStats:
    """What the router counted for one instance (monotonic counters)."""

    routed: int = 0
    failed: int = 0
    stalls: int = 0  # times it left routing for holding requests without progress
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0  # prompt tokens not served from any cache


class Board:
    """The latest :class:`InstanceLoad` per instance plus the router's in-flight accounting.

    Contract: confined to one thread (the gateway's event loop); nothing is locked and nothing
    blocks. ``clock`` (monotonic seconds) stamps the records it makes, so a simulator drives it
    on its own time. A member with a ``cores`` attribute (the cluster's ``InstanceSpec``) is
    pinned there; members pinned to a common core count each other's requests as
    ``core_peer_reqs``. Subclasses learn when an instance leaves routing and when it returns
    through :meth:`_left` and :meth:`_returned` (the gateway wakes the requests waiting on it).
    """

    def __init__(self, specs: Sequence[Member], clock: Callable[[], float] = time.monotonic,
                 stall_after_s: float = STALL_AFTER_S):  # fmt: skip
        self.specs = specs
        self.clock = clock
        self.stall_after_s = stall_after_s  # 0: never
        self._progress: dict[str, tuple[float, float]] = {}  # url -> (published_at, since)
        self._stalled: set[str] = set()
        self.stats: dict[str, InstanceStats] = defaultdict(InstanceStats)
        self._inflight: dict[str, _Inflight] = defaultdict(_Inflight)
        self._failures: dict[str, int] = defaultdict(int)
        self._dead: set[str] = set()
        self._roles: dict[str, Role] = {spec.url: Role(spec.role) for spec in specs}
        self._computes_on: dict[str, tuple[int, ...]] = {}  # url -> cores, where not all
        self._peers = core_peers(specs)
        now = clock()
        self.loads: dict[str, InstanceLoad] = {
            spec.url: InstanceLoad(url=spec.url, role=spec.role, updated_at=now) for spec in specs
        }

    def replace_spec(self, spec: Member) -> None:
        """The instance at ``spec.url`` runs as ``spec`` from now on (its cores may differ:
        the core neighbours are worked out again). Its role and load record stay."""
        self.specs = [spec if s.url == spec.url else s for s in self.specs]
        self._computes_on.pop(spec.url, None)
        self._peers = core_peers(self.specs, self._computes_on)

    def computes_on(self, url: str, cores: Sequence[int]) -> None:
        """The instance at ``url`` computes on ``cores`` only (some of those it is pinned to:
        a split instance whose boundary is at L leaves its second stage's cores idle), so only
        the members pinned there are its neighbours."""
        if self._computes_on.get(url) != tuple(cores):  # asked every tick; mostly unchanged
            self._computes_on[url] = tuple(cores)
            self._peers = core_peers(self.specs, self._computes_on)

    def role_of(self, url: str) -> Role:
        """The role ``url`` serves in now."""
        return self._roles[url]

    def set_role(self, url: str, role: Role) -> Role:
        """Route ``url`` as a ``role`` instance from now on; its previous role."""
        previous, self._roles[url] = self._roles[url], Role(role)
        self.loads[url] = replace(self.loads[url], role=str(role))
        return previous

    def candidates(self, role: str) -> list[InstanceLoad]:
        """Every instance of ``role``, healthy or not, with the router's in-flight work: the
        requests of the healthy instances that share its cores (``core_peer_reqs``), the
        output tokens owed on those cores (``core_decode_tokens``) and its handoffs' prompts
        waiting (``queued_handoff_tokens``)."""
        merged = {spec.url: self._with_inflight(spec.url) for spec in self.specs}
        out = []
        for spec in self.specs:
            if self._roles[spec.url] != role:
                continue
            peers = [peer for peer in self._peers[spec.url] if merged[peer].healthy]
            out.append(replace(
                merged[spec.url],
                core_peer_reqs=sum(merged[peer].batch_reqs for peer in peers),
                core_decode_tokens=sum(self._inflight[u].decode_tokens for u in [spec.url, *peers]),
                queued_handoff_tokens=self._inflight[spec.url].handoff_tokens,
            ))  # fmt: skip
        return out

    def _with_inflight(self, url: str) -> InstanceLoad:
        inflight = self._inflight[url]
        return with_inflight(self.loads[url], inflight.requests, inflight.prefill_tokens)

    def healthy(self, role: str) -> list[InstanceLoad]:
        return [load for load in self.candidates(role) if load.healthy]

    def begin(self, url: str, prefill_tokens: int, handoff: bool = False,
              decode_tokens: int = 0) -> None:  # fmt: skip
        """A request was sent to ``url``; ``prefill_tokens`` of its prompt count as queued
        prefill work there until :meth:`end`, and with ``handoff`` (a handoff's prefill step)
        as queued handoff work too; ``decode_tokens``, the most it may generate, count as owed
        there until :meth:`end`."""
        inflight = self._inflight[url]
        inflight.requests += 1
        inflight.prefill_tokens += prefill_tokens
        inflight.handoff_tokens += prefill_tokens if handoff else 0
        inflight.decode_tokens += decode_tokens
        self.stats[url].routed += 1

    def end(self, url: str, prefill_tokens: int, handoff: bool = False,
            decode_tokens: int = 0) -> None:  # fmt: skip
        """The request :meth:`begin` booked on ``url`` ended (answered, failed or abandoned);
        the counts as booked."""
        inflight = self._inflight[url]
        inflight.requests -= 1
        inflight.prefill_tokens -= prefill_tokens
        inflight.handoff_tokens -= prefill_tokens if handoff else 0
        inflight.decode_tokens -= decode_tokens

    def prefilled(self, url: str, prefill_tokens: int, handoff: bool = False) -> None:
        """The prompt of a request :meth:`begin` booked on ``url`` was computed (its first
        token came back): its ``prefill_tokens`` stop counting as queued there."""
        inflight = self._inflight[url]
        inflight.prefill_tokens -= prefill_tokens
        inflight.handoff_tokens -= prefill_tokens if handoff else 0

    def inflight_requests(self, url: str) -> int:
        """Requests sent to ``url`` that have not ended."""
        return self._inflight[url].requests

    def count_prompt(self, url: str, prompt_tokens: int, cached_tokens: int) -> None:
        stats = self.stats[url]
        stats.prompt_tokens += prompt_tokens
        stats.computed_prompt_tokens += max(0, prompt_tokens - cached_tokens)

    def mark_failed(self, url: str, why: str) -> None:
        """A request to ``url`` failed to connect: out of routing until a poll succeeds."""
        self.stats[url].failed += 1
        if self.loads[url].healthy:
            logger.warning("%s leaves routing: %s", url, why)
        self._set_unhealthy(url)

    def mark_dead(self, url: str) -> None:
        """The process exited: out of routing, polls ignored, until :meth:`revive`."""
        self._dead.add(url)
        self._set_unhealthy(url)

    def revive(self, url: str) -> None:
        """A restarted instance serves again: back in routing at once (its next poll
        refreshes the load record)."""
        self._dead.discard(url)
        self._failures[url] = 0
        self._stalled.discard(url)
        self._progress.pop(url, None)
        self._returned(url)
        self.loads[url] = replace(self.loads[url], healthy=True, updated_at=self.clock())

    def record_poll(self, spec: Member, answer: object | None, why: str = "") -> None:
        """One poll of ``spec``'s ``/v1/loads``: its decoded JSON answer, or None and why the
        poll failed. An answer of the wrong shape counts as a failed poll."""
        url = spec.url
        if url in self._dead:
            return
        load = None
        if answer is not None:
            try:
                load = load_from_loads(url, str(self._roles[url]), answer, self.clock())
            except ValueError as exc:
                why = f"unreadable load report: {exc}"
        if load is None:
            self._failures[url] += 1
            if self._failures[url] >= FAILURES_BEFORE_DOWN and self.loads[url].healthy:
                logger.warning("%s leaves routing: %s", spec.name, why or "no load report")
                self._set_unhealthy(url)
            return
        self._failures[url] = 0
        if self._stalls(url, load):
            if self.loads[url].healthy:
                self.stats[url].stalls += 1
                logger.warning(
                    "%s leaves routing: its scheduler published nothing for %.0f s while "
                    "holding %d requests", spec.name, self.stall_after_s,
                    max(load.batch_reqs, self._inflight[url].requests),
                )  # fmt: skip
                self._stalled.add(url)
                self._set_unhealthy(url)
            self.loads[url] = replace(load, healthy=False)
            return
        if not self.loads[url].healthy:
            logger.info("%s is back in routing", spec.name)
            self._returned(url)
        self.loads[url] = load

    def _stalls(self, url: str, load: InstanceLoad) -> bool:
        """Whether ``url`` has stalled or stays stalled, given its new ``load``."""
        if self.stall_after_s <= 0 or load.published_at <= 0:
            return False  # off, or an SGLang that does not say when it published
        now = self.clock()
        published, since = self._progress.get(url, (load.published_at, now))
        busy = load.batch_reqs > 0 or self._inflight[url].requests > 0
        if load.published_at != published or (not busy and url not in self._stalled):
            self._progress[url] = (load.published_at, now)
            self._stalled.discard(url)
            return False
        self._progress[url] = (published, since)
        return url in self._stalled or now - since >= self.stall_after_s

    def is_stalled(self, url: str) -> bool:
        """Out of routing for holding requests without progress (see the module's text)."""
        return url in self._stalled

    def unstalled(self, url: str) -> None:
        """A probe got through ``url``'s scheduler: back in routing at its next good poll."""
        if url in self._stalled:
            self._stalled.discard(url)
            published, _ = self._progress.get(url, (0.0, 0.0))
            self._progress[url] = (published, self.clock())

    def _set_unhealthy(self, url: str) -> None:
        self.loads[url] = replace(self.loads[url], healthy=False)
        self._left(url)

    def _left(self, url: str) -> None:
        """``url`` left routing (a hook: the board itself keeps no waiters)."""

    def _returned(self, url: str) -> None:
        """``url`` is back in routing (a hook)."""


def core_peers(
    specs: Sequence[Member], computes_on: Mapping[str, Sequence[int]] | None = None
) -> dict[str, tuple[str, ...]]:
    """Each member's url -> the urls of the other members pinned to a core it runs on (a
    member without ``cores``, or with none, shares no core); ``computes_on`` (url -> cores)
    narrows a member to the cores it computes on."""
    narrowed = computes_on or {}
    cores = {
        spec.url: set(narrowed.get(spec.url, getattr(spec, "cores", ()) or ())) for spec in specs
    }
    return {
        url: tuple(other for other in cores if other != url and mine & cores[other])
        for url, mine in cores.items()
    }
