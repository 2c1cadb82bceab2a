"""Routing policies: which instance of a role gets the next request.

A policy decides from the candidates' :class:`InstanceLoad` records (and the prompt, for the
cache-aware baseline) alone: no I/O, no clocks it was not given, so the cluster simulator runs
the very code the gateway runs. The load-aware choices are pure functions; where a policy needs
state by nature (a round-robin cursor, sglang-router's per-worker trees and in-flight counts),
the state lives in the policy object under its own lock, because the gateway calls from an
asyncio loop and possibly from worker threads.

BanaServe's policy is ``load_aware``: with the global KV store every instance can fetch every
cached prefix, so the router weighs load only. ``cache_aware`` (sglang-router's default) and
``round_robin`` are the baselines it is measured against.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from banaserve.router.base import Policy, check_role, healthy_candidates
from banaserve.router.cache_aware import CacheAwarePolicy
from banaserve.router.load import InstanceLoad

#: The names :func:`make_policy` accepts.
POLICY_NAMES: tuple[str, ...] = ("load_aware", "cache_aware", "round_robin")

#: A decode instance whose KV pool is at least this full ranks behind every one that is not.
DECODE_KV_HIGH_WATERMARK = 0.9


def load_aware_prefill(candidates: Sequence[InstanceLoad], role: str = "prefill") -> InstanceLoad:
    """The healthy instance with the fewest queued prefill tokens.

    Ties go to fewer requests on the instance's cores (:attr:`InstanceLoad.core_reqs`: its
    own queued+running ones and those of instances pinned to the same cores, which time-share
    them), then to the smaller url, so the choice is deterministic. Queued prompt tokens are
    what a new request waits behind before its first token; cache affinity is deliberately
    ignored, since the global store makes every instance's prefix cache the same.
    """
    return min(
        healthy_candidates(candidates, role),
        key=lambda c: (c.queued_prefill_tokens, c.core_reqs, c.url),
    )


def decode_sort_key(c: InstanceLoad) -> tuple[bool, int, int, int, str]:
    """The decode ordering, smallest first: (KV saturated, output tokens owed on its cores,
    requests on its cores, -free KV, url).

    1. KV saturation (usage >= :data:`DECODE_KV_HIGH_WATERMARK`) first: SGLang's decode admits
       a request only when its KV fits and retracts running requests when the pool runs out,
       so a short batch on a nearly full pool is not spare capacity.
    2. Then the fewest output tokens owed on its cores (:attr:`InstanceLoad.core_decode_tokens`:
       the ``max_new_tokens`` of the router's requests there, its own and those of instances
       pinned to the same cores). A decode step's time grows with the batch it runs (on a CPU
       core about in proportion), so a core's requests end when its tokens are done, and the
       core owing fewer frees first. Instances that time-share a CPU core slow each other as
       much: in the 2P+1D layout on two cores the decode instance shares core 0 with a
       prefill instance. Tokens rather than requests: when 16 long requests arrive at once,
       alternating by count leaves one core owing far more (by the luck of the draw, as
       round robin does); each to the core owing less finishes both about together.
    3. Then the requests on its cores (:attr:`InstanceLoad.core_reqs`: its batch, running +
       queued, plus that of the instances pinned to the same cores): among them the router's
       own and the instance's, which the router did not book (a prefill step owes no output).
    4. Then the most free KV: with equal batches, the one with shorter contexts (cheaper steps)
       and more headroom for this request's growth.
    5. Then the url, for determinism.

    Lexicographic rather than a weighted sum: no weight converts requests into KV tokens that
    holds across models and pool sizes, and the simulator must reproduce choices exactly.
    """
    saturated = c.kv_capacity_tokens > 0 and c.kv_usage >= DECODE_KV_HIGH_WATERMARK
    return (saturated, c.core_decode_tokens, c.core_reqs, -c.kv_free_tokens, c.url)


def load_aware_decode(candidates: Sequence[InstanceLoad], role: str = "decode") -> InstanceLoad:
    """The healthy decode instance first in :func:`decode_sort_key` order."""
    return min(healthy_candidates(candidates, role), key=decode_sort_key)


class LoadAwarePolicy:
    """BanaServe's policy: :func:`load_aware_prefill` or :func:`load_aware_decode` by role.

    ``mixed`` instances use the prefill ordering: a new request's first wait there is its
    prefill. Stateless (so no lock): the gateway merges its in-flight accounting into the
    records (:func:`banaserve.router.load.with_inflight`) before calling ``choose``.
    """

    name = "load_aware"

    def __init__(self, role: str) -> None:
        self.role = check_role(role)
        self._choose: Callable[[Sequence[InstanceLoad], str], InstanceLoad] = (
            load_aware_decode if role == "decode" else load_aware_prefill
        )

    def choose(self, candidates: Sequence[InstanceLoad], prompt: str) -> InstanceLoad:
        return self._choose(candidates, self.role)

    def on_done(self, url: str, prompt: str) -> None:
        pass


class RoundRobinPolicy:
    """Cycles through the healthy candidates in url order, as sglang-router's ``round_robin``.

    The cursor advances once per ``choose`` and indexes the healthy candidates sorted by url
    (so the caller's ordering does not matter); an unhealthy instance is skipped. The cursor
    is guarded by a lock.
    """

    name = "round_robin"

    def __init__(self, role: str = "mixed") -> None:
        self.role = check_role(role)
        self._lock = threading.Lock()
        self._next = 0

    def choose(self, candidates: Sequence[InstanceLoad], prompt: str) -> InstanceLoad:
        healthy = sorted(healthy_candidates(candidates, self.role), key=lambda c: c.url)
        with self._lock:
            index = self._next
            self._next += 1
        return healthy[index % len(healthy)]

    def on_done(self, url: str, prompt: str) -> None:
        pass


def make_policy(name: str, role: str, clock: Callable[[], float] = time.monotonic) -> Policy:
    """The policy called ``name`` (one of :data:`POLICY_NAMES`) for instances of ``role``;
    ``clock`` times whatever the policy does by time (``cache_aware``'s tree eviction).

    Raises ``ValueError`` naming the valid choices for an unknown name or role.
    """
    check_role(role)
    if name == "load_aware":
        return LoadAwarePolicy(role)
    if name == "round_robin":
        return RoundRobinPolicy(role)
    if name == "cache_aware":
        return CacheAwarePolicy(role, clock=clock)
    raise ValueError(f"unknown routing policy {name!r}: one of {', '.join(POLICY_NAMES)}")
