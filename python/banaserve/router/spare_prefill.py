"""Roles as preferences: a long request runs on a prefill instance whose cores are spare.

A request that generates more than ``in_place_max_new_tokens`` tokens belongs on a decode
instance, so that its decode never slows a prefill. But when prompts are few and outputs long,
the prefill instances' cores idle while every long request queues on the decode instances'
(on 2P+1D over two cores: 100 of 100 chat requests on decode-0, prefill-1's core idle;
issue 30). Then the request runs on the prefill instance whose cores owe the fewest output
tokens (then hold the fewest requests), if that is less than the decode instance the decode
policy chose, and if no handoff's prompt waits there for its prefill step. A handoff's serve
step may go there too (its prompt's KV is in the store, so it loads on any instance), except
to the instance that prefilled it: the router leaves that one out.

Only prompts computed for other requests too (handoffs', and leading short requests':
:mod:`.placement`) close a prefill instance (:attr:`InstanceLoad.queued_handoff_tokens`):
a long direct request's own prompt is prefilled wherever it runs, so counting it made a burst
of long requests pile onto the decode instance (16 arriving at once: the first two or three
filled prefill-1's queue past the bar, and the rest went to decode-0 until their first tokens
came back). When prompts return, the prefill steps come first: SGLang's scheduler runs a
waiting prefill before the next decode step, the handoffs' prefill policy picks the instance
with the fewest queued prompt tokens, and no further long request goes to an instance where a
handoff's prompt waits.

Pure: a decision over the board's :class:`InstanceLoad` records (the router's in-flight work
merged in), so the simulator decides as the gateway does.

A long request whose prompt needs a handoff is not handed off when its serve step would take a
spare prefill instance: it runs there whole, prompt and decode, as on a colocated instance
(:func:`spare_prefill_serves`; :class:`~banaserve.router.placement.Placer` counts it as a
spill). Handed off, its prompt would go to the prefill instance with the fewest queued prompt
tokens, which on two cores is the spare one, and its decode then never there (it prefilled
it): on ``compare.py``'s uniform_long, every request a handoff, 10 of 11 decodes ran on
decode-0's core while prefill-1's was busy 40% of the run (RESULTS.md, session 26).
"""

from __future__ import annotations

from collections.abc import Sequence

from banaserve.router.load import InstanceLoad
from banaserve.router.policies import decode_sort_key, load_aware_decode

#: Whether long requests may run on spare prefill instances (the ``--serve-on-spare-prefill``
#: default).
SERVE_ON_SPARE_PREFILL = True


def spare_prefill_or(chosen: InstanceLoad, prefill: Sequence[InstanceLoad]) -> InstanceLoad:
    """``chosen`` (the decode policy's pick for a long request), or the prefill instance of
    ``prefill`` first in :func:`decode_sort_key` order among those that are healthy, not KV
    saturated and hold no handoff's prompt waiting for its prefill step, when its cores owe
    fewer output tokens (:attr:`InstanceLoad.core_decode_tokens`) than ``chosen``'s, or as
    many and hold fewer requests (:attr:`InstanceLoad.core_reqs`)."""
    spare = [
        c for c in prefill
        if c.healthy and c.queued_handoff_tokens == 0 and not decode_sort_key(c)[0]
    ]  # fmt: skip
    if not spare:
        return chosen
    best = min(spare, key=decode_sort_key)
    return best if core_work(best) < core_work(chosen) else chosen


def core_work(c: InstanceLoad) -> tuple[int, int]:
    """What ``c``'s cores hold: output tokens owed, then requests."""
    return c.core_decode_tokens, c.core_reqs


def spare_prefill_serves(serving: Sequence[InstanceLoad], prefill: Sequence[InstanceLoad]) -> bool:
    """Whether a long request's serve step would go to a spare instance of ``prefill``
    (:func:`spare_prefill_or`) rather than to the ``load_aware`` decode choice among the
    healthy ones of ``serving`` (False when none is healthy)."""
    if not any(c.healthy for c in serving):
        return False
    chosen = load_aware_decode(serving)
    return spare_prefill_or(chosen, prefill) is not chosen
