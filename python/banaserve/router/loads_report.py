"""Read an SGLang 0.5.23 server's ``GET /v1/loads`` answer into an :class:`InstanceLoad`.

Why ``/v1/loads`` and not ``/metrics``: each scheduler publishes a load snapshot to shared
memory (``sglang/srt/managers/load_snapshot.py``) after every prefill batch, on going idle, and
every ``--load-snapshot-publish-interval`` decode steps, and the HTTP process answers from that
mapping without asking the scheduler. On this machine (SmolLM2-135M, one instance, idle) a
``/v1/loads`` answer costs the instance 1.3 ms of CPU and a ``/metrics`` scrape 9.2 ms, whose
text then took the gateway 3.3 ms to parse (benchmark/RESULTS.md, session 20); and
``/metrics``' gauges move only every ``--decode-log-interval`` (40) decode steps.

The answer is ``{"loads": [one snapshot per DP rank], ...}``. Fields read per snapshot (every
other is ignored):

- ``num_running_reqs``: the running batch.
- ``num_waiting_reqs``: the waiting queue plus, in PD mode, the bootstrap / prealloc /
  transfer / retracted queues; ``queues.grammar`` (requests waiting for a grammar) is added, as
  SGLang counts it apart.
- ``num_waiting_uncached_tokens``: prompt tokens still to prefill, net of cache hits.
- ``num_used_tokens``: KV slots held by live requests; ``max_total_num_tokens``: the KV pool.
- ``gen_throughput``: decode tokens/s.
- ``timestamp``: when the scheduler published the snapshot (the latest over DP ranks), so
  the board can tell a scheduler that stopped making progress (:mod:`banaserve.router.board`).

DP ranks each have their own requests and KV pool, so counts are summed and throughputs too.
A missing field reads as 0; a negative, non-finite or non-numeric one makes the answer invalid
(:class:`ValueError`), as does an answer that is not an object with a ``loads`` list.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from banaserve.router.load import InstanceLoad

#: The answer's path on an SGLang server.
LOADS_PATH = "/v1/loads"
#: BanaServe's instances publish their snapshot after every decode step (SGLang's default is
#: 15, ~2 s of CPU decode here): 200 steps of an 8-request batch cost the scheduler the same
#: CPU with 1 as with 1000, within noise (benchmark/RESULTS.md, session 20).
PUBLISH_EVERY_DECODE_STEPS = 1

_COUNTS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "max_total_num_tokens",
)


def _number(snapshot: Mapping[str, Any], name: str) -> float:
    value = snapshot.get(name, 0)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} is not a number: {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return float(value)


def load_from_loads(
    url: str, role: str, answer: Any, now: float, *, healthy: bool = True
) -> InstanceLoad:
    """Build the InstanceLoad of instance ``url`` from its ``/v1/loads`` answer (decoded
    JSON) read at ``now``. Raises ``ValueError`` for an answer of the wrong shape or values,
    and for an invalid ``role``."""
    if not isinstance(answer, Mapping) or not isinstance(answer.get("loads"), list):
        raise ValueError("a /v1/loads answer is an object with a 'loads' list")
    totals = dict.fromkeys((*_COUNTS, "grammar", "gen_throughput"), 0.0)
    published = 0.0
    for snapshot in answer["loads"]:
        if not isinstance(snapshot, Mapping):
            raise ValueError(f"a load snapshot is an object, got {snapshot!r}")
        published = max(published, _number(snapshot, "timestamp"))
        for name in (*_COUNTS, "gen_throughput"):
            totals[name] += _number(snapshot, name)
        queues = snapshot.get("queues") or {}
        if not isinstance(queues, Mapping):
            raise ValueError(f"queues is an object, got {queues!r}")
        totals["grammar"] += _number(queues, "grammar")
    return InstanceLoad(
        url=url,
        role=role,
        healthy=healthy,
        queued_reqs=int(totals["num_waiting_reqs"] + totals["grammar"]),
        running_reqs=int(totals["num_running_reqs"]),
        queued_prefill_tokens=int(totals["num_waiting_uncached_tokens"]),
        kv_used_tokens=int(totals["num_used_tokens"]),
        kv_capacity_tokens=int(totals["max_total_num_tokens"]),
        gen_tokens_per_s=totals["gen_throughput"],
        updated_at=now,
        published_at=published,
    )
