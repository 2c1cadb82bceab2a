"""Live load of every instance: one producer (a poller) per instance, read by the router.

Each instance's record comes from its own ``/metrics`` (SGLang's Prometheus counters),
polled every :data:`POLL_INTERVAL_S`, merged with what the gateway itself knows it sent and
has not seen finish (metrics lag behind a burst by up to one poll). An instance whose process
exited is out of routing until the supervisor has restarted it; one that failed
:data:`FAILURES_BEFORE_DOWN` polls in a row leaves routing until a later good poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import aiohttp

from banaserve.cluster.topology import InstanceSpec
from banaserve.router.load import InstanceLoad, with_inflight
from banaserve.router.metrics_parse import load_from_metrics

logger = logging.getLogger("banaserve.cluster")

POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 2.0
FAILURES_BEFORE_DOWN = 3


@dataclass
class _Inflight:
    requests: int = 0
    prefill_tokens: int = 0


@dataclass
class InstanceStats:
    """What the gateway counted for one instance (monotonic counters)."""

    routed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0  # prompt tokens not served from any cache


@dataclass
class LoadBoard:
    """The latest load record per instance. Used from the gateway's event loop only (no
    lock: asyncio runs one callback at a time)."""

    specs: Sequence[InstanceSpec]
    loads: dict[str, InstanceLoad] = field(default_factory=dict)
    stats: dict[str, InstanceStats] = field(default_factory=lambda: defaultdict(InstanceStats))
    _inflight: dict[str, _Inflight] = field(default_factory=lambda: defaultdict(_Inflight))
    _failures: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _dead: set[str] = field(default_factory=set)
    _gone: dict[str, asyncio.Event] = field(default_factory=dict)

    def __post_init__(self) -> None:
        now = time.monotonic()
        for spec in self.specs:
            self.loads[spec.url] = InstanceLoad(
                url=spec.url, role=spec.role, healthy=True, queued_reqs=0, running_reqs=0,
                queued_prefill_tokens=0, kv_used_tokens=0, kv_capacity_tokens=0,
                gen_tokens_per_s=0.0, updated_at=now,
            )  # fmt: skip

    def candidates(self, role: str) -> list[InstanceLoad]:
        """Every instance of ``role``, healthy or not, with the gateway's in-flight work."""
        out = []
        for spec in self.specs:
            if spec.role != role:
                continue
            inflight = self._inflight[spec.url]
            out.append(
                with_inflight(self.loads[spec.url], inflight.requests, inflight.prefill_tokens)
            )
        return out

    def healthy(self, role: str) -> list[InstanceLoad]:
        return [load for load in self.candidates(role) if load.healthy]

    def begin(self, url: str, prefill_tokens: int) -> None:
        inflight = self._inflight[url]
        inflight.requests += 1
        inflight.prefill_tokens += prefill_tokens
        self.stats[url].routed += 1

    def end(self, url: str, prefill_tokens: int) -> None:
        inflight = self._inflight[url]
        inflight.requests -= 1
        inflight.prefill_tokens -= prefill_tokens

    def prefill_done(self, url: str, prefill_tokens: int) -> None:
        """The prompt is computed: it no longer counts as queued prefill work."""
        self._inflight[url].prefill_tokens -= prefill_tokens

    def inflight_requests(self, url: str) -> int:
        """Requests the gateway sent to ``url`` and has not seen end."""
        return self._inflight[url].requests

    def count_prompt(self, url: str, prompt_tokens: int, cached_tokens: int) -> None:
        stats = self.stats[url]
        stats.prompt_tokens += prompt_tokens
        stats.computed_prompt_tokens += max(0, prompt_tokens - cached_tokens)

    def gone_event(self, url: str) -> asyncio.Event:
        """Set when ``url`` leaves routing, so requests waiting on it stop waiting."""
        event = self._gone.get(url)
        if event is None:
            event = self._gone[url] = asyncio.Event()
        return event

    def _set_unhealthy(self, url: str) -> None:
        self.loads[url] = replace(self.loads[url], healthy=False)
        self.gone_event(url).set()

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
        self._gone.pop(url, None)
        self.loads[url] = replace(self.loads[url], healthy=True, updated_at=time.monotonic())

    def record_poll(self, spec: InstanceSpec, text: str | None, why: str = "") -> None:
        url = spec.url
        if url in self._dead:
            return
        if text is None:
            self._failures[url] += 1
            if self._failures[url] >= FAILURES_BEFORE_DOWN and self.loads[url].healthy:
                logger.warning("%s leaves routing: %s", spec.name, why or "no metrics")
                self._set_unhealthy(url)
            return
        if not self.loads[url].healthy:
            logger.info("%s is back in routing", spec.name)
            self._gone.pop(url, None)
        self._failures[url] = 0
        self.loads[url] = load_from_metrics(url, spec.role, text, time.monotonic())


async def poll_forever(board: LoadBoard, session: aiohttp.ClientSession) -> None:
    """Poll every instance's ``/metrics`` until cancelled."""
    timeout = aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)

    async def poll(spec: InstanceSpec) -> None:
        try:
            async with session.get(f"{spec.url}/metrics", timeout=timeout) as response:
                if response.status != 200:
                    board.record_poll(spec, None, f"/metrics answered {response.status}")
                    return
                board.record_poll(spec, await response.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            board.record_poll(spec, None, f"/metrics failed: {exc!r}")

    while True:
        await asyncio.gather(*(poll(spec) for spec in board.specs))
        await asyncio.sleep(POLL_INTERVAL_S)
