"""When the prefill instances are backed up, or a serving instance is idle, a long prompt runs
whole where cores are free.

A handoff sends a prompt's prefill to a prefill instance so that long prefills never stall a
decode instance's batch. That pays while the prefill instances keep up. When they do not (a
run of long prompts: a prefill-heavy phase), every new prompt queues behind
theirs while a decode instance's core sits idle, and the cluster prefills on a fraction of its
cores: on 1P+1D, one of two (migration_bench in RESULTS.md). Then the prompt *spills*: it runs
whole, as a direct request, where the router's usual direct pick puts it, but only onto decode
cores holding fewer requests than that prefill instance's, because its prefill stalls the
decodes there for as long as it takes. (A short request, generating at most
``in_place_max_new_tokens`` tokens, is never handed off in the first place:
:mod:`.placement`.)

A handoff also spills when a serving instance's cores hold no request at all
(:func:`serving_idle`): its prefill there would stall no decode, which is all a handoff
protects, and a handoff would add its costs, a second request and the KV's round trip through
the store. On 2P+1D over two cores, chat's opening burst (4 new conversations at once) was 3
handoffs of 4, the first with its prefill step on prefill-0, beside decode-0 on core 0
(RESULTS.md, session 30).

Pure: a decision over the board's :class:`InstanceLoad` records (with the router's in-flight
work merged in), nothing else, so the simulator decides as the gateway does.
"""

from __future__ import annotations

from collections.abc import Sequence

from banaserve.router.load import InstanceLoad
from banaserve.router.policies import load_aware_prefill

#: Whether a cluster spills prompts when its prefill instances are backed up or a serving
#: instance is idle (the ``--spill-prefill`` default).
SPILL_PREFILL = True


def prefill_backlogged(
    prefill: Sequence[InstanceLoad], serve: Sequence[InstanceLoad], min_tokens: int
) -> bool:
    """Whether a new long prompt should run whole as a direct request instead of queueing for
    a prefill step.

    ``prefill``: the instances that take prefill steps; ``serve``: those that serve a direct
    request of long output (decode and mixed ones). The prompt spills when the prefill
    instance it would go to (:func:`load_aware_prefill`'s choice) already holds at least
    ``min_tokens`` (at least 1) prompt tokens to prefill, so it would wait, and some serving
    instance's cores hold fewer requests (:attr:`InstanceLoad.core_reqs`, neighbours on the
    same cores included) than that prefill instance's. Unhealthy records are ignored; False
    when no prefill or no serving instance is healthy.
    """
    prefill = [c for c in prefill if c.healthy]
    serve = [c for c in serve if c.healthy]
    if not prefill or not serve:
        return False
    target = load_aware_prefill(prefill)
    if target.queued_prefill_tokens < max(1, min_tokens):
        return False
    return min(c.core_reqs for c in serve) < target.core_reqs


def serving_idle(serve: Sequence[InstanceLoad]) -> bool:
    """Whether a long prompt that needs a handoff should run whole because some healthy
    instance of ``serve`` (decode and mixed ones) holds no request on its cores
    (:attr:`InstanceLoad.core_reqs`, neighbours on the same cores included): there its
    prefill stalls no decode. The router's usual direct pick then takes that instance, or a
    spare prefill instance as idle."""
    return any(c.healthy and c.core_reqs == 0 for c in serve)
