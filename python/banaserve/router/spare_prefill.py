"""Roles as preferences: a long request runs on a prefill instance whose cores are spare.

A direct request (a handoff's serve step is not: its prompt was prefilled to leave the
prefill instance) that generates more than ``in_place_max_new_tokens`` tokens belongs on a
decode instance, so that its decode never slows a prefill. But when prompts are few and
outputs long, the prefill instances' cores idle while every long request queues on the
decode instances' (on 2P+1D over two cores: 100 of 100 chat requests on decode-0, prefill-1's
core idle; issue 30). Then the request runs on the prefill instance with the fewest requests
on its cores, if that is fewer than on the decode instance the decode policy chose, and if no
prompt waits there for a prefill step (fewer queued prompt tokens than a handoff carries).
When prompts return, the prefill steps come first: SGLang's scheduler runs a waiting prefill
before the next decode step, the handoffs' prefill policy picks the instance with the fewest
queued prompt tokens, and no further long request goes to an instance with a prompt waiting.

Pure: a decision over the board's :class:`InstanceLoad` records (the router's in-flight work
merged in), so the simulator decides as the gateway does.
"""

from __future__ import annotations

from collections.abc import Sequence

from banaserve.router.load import InstanceLoad
from banaserve.router.policies import decode_sort_key

#: Whether long requests may run on spare prefill instances (the ``--serve-on-spare-prefill``
#: default).
SERVE_ON_SPARE_PREFILL = True


def spare_prefill_or(
    chosen: InstanceLoad, prefill: Sequence[InstanceLoad], min_tokens: int
) -> InstanceLoad:
    """``chosen`` (the decode policy's pick for a long request), or the prefill instance of
    ``prefill`` first in :func:`decode_sort_key` order among those that are healthy, not KV
    saturated and hold fewer than ``min_tokens`` (at least 1) queued prompt tokens, when its
    cores hold fewer requests (:attr:`InstanceLoad.core_reqs`) than ``chosen``'s."""
    spare = [
        c for c in prefill
        if c.healthy and c.queued_prefill_tokens < max(1, min_tokens) and not decode_sort_key(c)[0]
    ]  # fmt: skip
    if not spare:
        return chosen
    best = min(spare, key=decode_sort_key)
    return best if best.core_reqs < chosen.core_reqs else chosen
