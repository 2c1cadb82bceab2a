"""sglang-router's ``cache_aware`` policy, reproduced as the baseline BanaServe is measured against.

Matched against ``sgl-project/sglang``: ``sgl-router/src/policies/cache_aware.rs``
(``select_worker``), ``sgl-router/src/policies/tree.rs`` (the approximate tree) and the
launcher defaults in ``sgl-router/py_src/sglang_router/router_args.py`` (``cache_threshold
0.3``, ``balance_abs_threshold 64``, ``balance_rel_threshold 1.5``, ``eviction_interval_secs
120``, ``max_tree_size 2**26``; the Rust ``CacheAwareConfig::default()`` differs, but the
command line, which is how sglang-router is run, uses these).

Per request, with ``load`` = the router's own count of its in-flight requests per worker:

1. If ``max_load - min_load > balance_abs_threshold`` and
   ``max_load > min_load * balance_rel_threshold``: the least-loaded worker (shortest queue).
2. Otherwise match the request text against every worker's tree. If the best match rate
   (matched characters / prompt characters) exceeds ``cache_threshold``: the worker with the
   longest match; else the worker with the smallest tree (most free cache).
3. Either way the text is inserted into the chosen worker's tree and its load goes up by one;
   ``on_done`` takes it down again.

The trees hold raw text characters, not tokens (no tokenizer on the routing path); a tree's size
is its character count; every ``eviction_interval_s`` the least recently used leaves are evicted
until each tree is within ``max_tree_size`` characters.

Deliberate differences, none of which changes a decision in a balanced, healthy cluster:
- One tree per worker instead of one multi-tenant tree: the longest match over per-worker trees
  equals the multi-tenant tree's, and it needs no per-node tenant maps.
- Ties (equal matches, equal tree sizes) go to the lower load, then the smaller url; Rust takes
  whichever tenant its hash map yields first.
- Loads, matches and tree sizes consider healthy candidates only; Rust counts every worker's
  load and falls back to the first healthy worker when its pick is unhealthy.
- Eviction runs inside ``choose`` once the interval has passed (on the injected clock), not on a
  background thread, so the simulator reproduces it exactly.
- LRU order uses a logical clock (one tick per insert), not wall milliseconds; only a match's
  insert refreshes recency, not the match itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from banaserve.router.base import check_role, healthy_candidates
from banaserve.router.load import InstanceLoad
from banaserve.router.prefix_tree import ApproxRadixTree

DEFAULT_CACHE_THRESHOLD = 0.3
DEFAULT_BALANCE_ABS_THRESHOLD = 64
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
DEFAULT_EVICTION_INTERVAL_S = 120.0
DEFAULT_MAX_TREE_SIZE = 2**26


class CacheAwarePolicy:
    """sglang-router's ``cache_aware`` policy (see the module docstring for the algorithm).

    State: one :class:`ApproxRadixTree` and one in-flight count per worker url, all under one
    lock; ``choose`` increments the chosen worker's count and ``on_done`` decrements it (never
    below 0). The reported :class:`InstanceLoad` numbers are not used: like sglang-router, the
    policy knows only what it routed. ``clock`` (default ``time.monotonic``) times eviction.
    """

    name = "cache_aware"

    def __init__(
        self,
        role: str = "mixed",
        *,
        cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
        balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
        eviction_interval_s: float = DEFAULT_EVICTION_INTERVAL_S,
        max_tree_size: int = DEFAULT_MAX_TREE_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.role = check_role(role)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self._clock = clock
        self._lock = threading.Lock()
        self._trees: dict[str, ApproxRadixTree] = {}
        self._inflight: dict[str, int] = {}
        self._stamp = 0
        self._last_eviction = clock()

    def choose(self, candidates: Sequence[InstanceLoad], prompt: str) -> InstanceLoad:
        healthy = healthy_candidates(candidates, self.role)
        with self._lock:
            self._maybe_evict_locked()
            for c in healthy:
                self._trees.setdefault(c.url, ApproxRadixTree())
                self._inflight.setdefault(c.url, 0)
            chosen = self._select_locked(healthy, prompt)
            self._stamp += 1
            self._trees[chosen.url].insert(prompt, self._stamp)
            self._inflight[chosen.url] += 1
        return chosen

    def _select_locked(self, healthy: Sequence[InstanceLoad], prompt: str) -> InstanceLoad:
        load = self._inflight
        max_load = max(load[c.url] for c in healthy)
        min_load = min(load[c.url] for c in healthy)
        imbalanced = (
            max_load - min_load > self.balance_abs_threshold
            and max_load > min_load * self.balance_rel_threshold
        )
        if imbalanced:
            return min(healthy, key=lambda c: (load[c.url], c.url))
        matches = {c.url: self._trees[c.url].match_len(prompt) for c in healthy}
        best = min(healthy, key=lambda c: (-matches[c.url], load[c.url], c.url))
        match_rate = matches[best.url] / len(prompt) if prompt else 0.0
        if match_rate > self.cache_threshold:
            return best
        return min(healthy, key=lambda c: (self._trees[c.url].size, load[c.url], c.url))

    def on_done(self, url: str, prompt: str) -> None:
        with self._lock:
            if self._inflight.get(url, 0) > 0:
                self._inflight[url] -= 1

    def inflight(self, url: str) -> int:
        """The policy's count of requests routed to ``url`` and not yet done."""
        with self._lock:
            return self._inflight.get(url, 0)

    def tree_size(self, url: str) -> int:
        """Characters in ``url``'s approximate tree (0 for a worker never seen)."""
        with self._lock:
            tree = self._trees.get(url)
            return tree.size if tree is not None else 0

    def evict(self) -> None:
        """Evict every tree down to ``max_tree_size`` now, and restart the interval."""
        with self._lock:
            self._evict_locked()

    def _maybe_evict_locked(self) -> None:
        # An interval of 0 disables eviction, as eviction_interval_secs=0 does in sglang-router.
        if self.eviction_interval_s <= 0:
            return
        if self._clock() - self._last_eviction >= self.eviction_interval_s:
            self._evict_locked()

    def _evict_locked(self) -> None:
        for tree in self._trees.values():
            tree.evict_to(self.max_tree_size)
        self._last_eviction = self._clock()
