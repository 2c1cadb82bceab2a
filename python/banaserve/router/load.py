"""One instance's live load: the record every routing and balancing decision reads.

There is one producer per instance (today the gateway's poller of the instance's ``/v1/loads``,
see :mod:`banaserve.router.loads_report`; later the simulator's model of an instance), and many
readers: the router's policies today, the migration controller and the simulator later. Records
are immutable, so a reader never sees one half-updated; a producer publishes a new record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from banaserve.router.base import ROLES

_COUNT_FIELDS = (
    "queued_reqs",
    "running_reqs",
    "queued_prefill_tokens",
    "kv_used_tokens",
    "kv_capacity_tokens",
    "core_peer_reqs",
    "queued_handoff_tokens",
    "core_decode_tokens",
)


@dataclass(frozen=True)
class InstanceLoad:
    """A snapshot of one instance's load.

    Contract:
    - ``url`` names the instance (its HTTP base URL) and is unique among instances.
    - ``role`` is one of :data:`ROLES`.
    - Counts are non-negative; ``kv_capacity_tokens`` is 0 when unknown (then no KV-based
      ordering can tell instances apart, which policies treat as "no information", not "full").
    - ``queued_reqs`` are admitted but not yet running (waiting queue, and in PD mode the
      bootstrap/prealloc/transfer queues); ``running_reqs`` are in the running batch.
    - ``queued_prefill_tokens`` are prompt tokens still waiting to be prefilled.
    - ``kv_used_tokens`` are KV slots held by live requests (not the evictable prefix cache,
      which the engine frees on demand).
    - ``core_peer_reqs`` are the requests (queued and running) of the *other* instances pinned
      to a core this one runs on. The instance does not know them; the router's board fills
      them in from the cluster's placement (0 where the instance has its cores to itself or
      nothing is pinned). On a CPU core two instances time-share, so a neighbour's batch slows
      this one's steps as much as its own does.
    - ``queued_handoff_tokens`` are the prompt tokens of handoffs' prefill steps (and of
      leading short requests, until their first token) that the router sent here and has not
      seen end: prompts waiting to be prefilled *for other requests*, which a prefill instance
      owes before any decode work. The instance cannot
      tell them from a direct request's prompt; the router's board fills them in (0 elsewhere).
    - ``core_decode_tokens`` are the output tokens that the router's requests on this
      instance's cores (its own and its core neighbours') may still generate, each booked at
      its ``max_new_tokens`` until it ends (the router sees no progress of a request that does
      not stream, so none is counted). The board fills it in (0 elsewhere). On a CPU core a
      decode step's time grows with its batch, so a core's requests finish when its tokens
      are done: of two cores with as many requests, the one owing fewer tokens frees first.
    - ``updated_at`` is the producer's ``time.monotonic()`` when the numbers were read: it is
      comparable only within the producing process.
    - ``published_at`` is when the instance's scheduler last published its numbers, on the
      instance's own clock (0.0 when it does not say): only a change of it means anything
      (the scheduler is making progress), never its value against another clock.

    Construction validates these and raises ``ValueError``.
    """

    url: str
    role: str
    healthy: bool = True
    queued_reqs: int = 0
    running_reqs: int = 0
    queued_prefill_tokens: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    gen_tokens_per_s: float = 0.0
    updated_at: float = 0.0
    core_peer_reqs: int = 0
    published_at: float = 0.0
    queued_handoff_tokens: int = 0
    core_decode_tokens: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"InstanceLoad.role must be one of {ROLES}, got {self.role!r}")
        for name in _COUNT_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"InstanceLoad.{name} must be >= 0, got {getattr(self, name)}")
        if self.gen_tokens_per_s < 0:
            raise ValueError(f"InstanceLoad.gen_tokens_per_s must be >= 0: {self.gen_tokens_per_s}")

    @property
    def kv_free_tokens(self) -> int:
        """KV slots not held by live requests (0 when the capacity is unknown)."""
        return max(0, self.kv_capacity_tokens - self.kv_used_tokens)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool held by live requests, in [0, 1]; 0.0 when unknown."""
        if self.kv_capacity_tokens <= 0:
            return 0.0
        return min(1.0, self.kv_used_tokens / self.kv_capacity_tokens)

    @property
    def batch_reqs(self) -> int:
        """Requests the instance holds: queued plus running."""
        return self.queued_reqs + self.running_reqs

    @property
    def core_reqs(self) -> int:
        """Requests on this instance's cores: its own and its core neighbours'."""
        return self.batch_reqs + self.core_peer_reqs

    def age_s(self, now: float) -> float:
        """Seconds since the numbers were read; ``now`` from the producer's monotonic clock."""
        return max(0.0, now - self.updated_at)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field, plus the derived ``kv_free_tokens``."""
        out = dataclasses.asdict(self)
        out["kv_free_tokens"] = self.kv_free_tokens
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> InstanceLoad:
        """Inverse of :meth:`to_json`; derived and unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def with_inflight(
    load: InstanceLoad, inflight_reqs: int, inflight_prefill_tokens: int
) -> InstanceLoad:
    """Merge the gateway's own accounting into an instance's report; returns a new record.

    ``inflight_reqs`` is the number of requests the gateway sent to this instance and has not
    seen finish; ``inflight_prefill_tokens`` the prompt tokens among them whose prefill the
    gateway has not seen complete.

    Why max() and not the report alone: the report is polled, so it lags. Between two polls a
    burst of requests would all see the same stale "idle" instance and pile onto it; the
    gateway's counts move the moment it sends. Why not the gateway's counts alone: the instance
    also holds work the gateway did not send or cannot see (other gateways, retractions, the
    engine's own queues). Each source is a lower bound on the truth, so the larger one is the
    better estimate. Requests the gateway knows of beyond the reported total have most likely
    just arrived, so the surplus is counted as queued, not running.

    Raises ``ValueError`` on negative counts (a gateway accounting bug, not a load).
    """
    if inflight_reqs < 0 or inflight_prefill_tokens < 0:
        raise ValueError(
            f"in-flight counts must be >= 0, got reqs={inflight_reqs} "
            f"prefill_tokens={inflight_prefill_tokens}"
        )
    unseen_reqs = max(0, inflight_reqs - load.batch_reqs)
    return dataclasses.replace(
        load,
        queued_reqs=load.queued_reqs + unseen_reqs,
        queued_prefill_tokens=max(load.queued_prefill_tokens, inflight_prefill_tokens),
    )
