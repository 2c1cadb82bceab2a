"""Routing: every decision of where a request runs, as pure code over typed load records.

Nothing in this package does I/O, reads a clock it was not given, or imports
:mod:`banaserve.cluster`, aiohttp or asyncio, so the gateway, the migration controller and the
simulator run the same decisions.

- :mod:`.base`: :class:`Role`, the :class:`Policy` contract, :class:`NoHealthyInstance`.
- :mod:`.load`: :class:`InstanceLoad`, the one typed load record per instance.
- :mod:`.loads_report`: an SGLang ``/v1/loads`` answer -> :class:`InstanceLoad`.
- :mod:`.board`: the latest record per instance and the router's in-flight accounting.
- :mod:`.request_shape`: :class:`RequestShape`, a request as the router sees it.
- :mod:`.placement`: handoff through the store or whole on one instance.
- :mod:`.spill`: a long prompt runs whole when the prefill instances are backed up.
- :mod:`.spare_prefill`: a long request runs on a prefill instance whose cores are spare.
- :mod:`.policies`: BanaServe's load-aware policy, round robin, :func:`make_policy`.
- :mod:`.cache_aware`: sglang-router's ``cache_aware`` policy, the baseline, over the
  approximate trees of :mod:`.prefix_tree`.
- :mod:`.router`: :class:`Router`, the facade the gateway calls (``plan``, ``pick``, ``done``).
"""

from banaserve.router.base import ROLES, NoHealthyInstance, Policy, Role, healthy_candidates
from banaserve.router.board import Board
from banaserve.router.cache_aware import CacheAwarePolicy
from banaserve.router.load import InstanceLoad, with_inflight
from banaserve.router.loads_report import LOADS_PATH, load_from_loads
from banaserve.router.placement import NoStorePlacer, Placement, Placer
from banaserve.router.policies import (
    POLICY_NAMES,
    LoadAwarePolicy,
    RoundRobinPolicy,
    decode_sort_key,
    load_aware_decode,
    load_aware_prefill,
    make_policy,
)
from banaserve.router.prefix_tree import ApproxRadixTree
from banaserve.router.request_shape import RequestShape
from banaserve.router.router import Pick, Router
from banaserve.router.spare_prefill import SERVE_ON_SPARE_PREFILL, spare_prefill_or
from banaserve.router.spill import SPILL_PREFILL, prefill_backlogged, serving_idle

__all__ = [
    "LOADS_PATH",
    "POLICY_NAMES",
    "ROLES",
    "SERVE_ON_SPARE_PREFILL",
    "SPILL_PREFILL",
    "ApproxRadixTree",
    "Board",
    "CacheAwarePolicy",
    "InstanceLoad",
    "LoadAwarePolicy",
    "NoHealthyInstance",
    "NoStorePlacer",
    "Pick",
    "Placement",
    "Placer",
    "Policy",
    "RequestShape",
    "Role",
    "RoundRobinPolicy",
    "Router",
    "decode_sort_key",
    "healthy_candidates",
    "load_aware_decode",
    "load_aware_prefill",
    "load_from_loads",
    "make_policy",
    "prefill_backlogged",
    "serving_idle",
    "spare_prefill_or",
    "with_inflight",
]
