"""Routing: instance load reports and the policies that choose an instance per request.

- :mod:`.load`: :class:`InstanceLoad`, the one typed load record per instance.
- :mod:`.metrics_parse`: SGLang ``/metrics`` text -> :class:`InstanceLoad`.
- :mod:`.policies`: the :class:`Policy` contract, BanaServe's load-aware policy, round robin.
- :mod:`.cache_aware`: sglang-router's ``cache_aware`` policy, the baseline.
"""

from banaserve.router.cache_aware import ApproxRadixTree, CacheAwarePolicy
from banaserve.router.load import ROLES, InstanceLoad, with_inflight
from banaserve.router.metrics_parse import load_from_metrics, parse_sglang_metrics
from banaserve.router.policies import (
    POLICY_NAMES,
    LoadAwarePolicy,
    NoHealthyInstance,
    Policy,
    RoundRobinPolicy,
    decode_sort_key,
    healthy_candidates,
    load_aware_decode,
    load_aware_prefill,
    make_policy,
)

__all__ = [
    "POLICY_NAMES",
    "ROLES",
    "ApproxRadixTree",
    "CacheAwarePolicy",
    "InstanceLoad",
    "LoadAwarePolicy",
    "NoHealthyInstance",
    "Policy",
    "RoundRobinPolicy",
    "decode_sort_key",
    "healthy_candidates",
    "load_aware_decode",
    "load_aware_prefill",
    "load_from_metrics",
    "make_policy",
    "parse_sglang_metrics",
    "with_inflight",
]
