"""What an instance's load record says about the work it holds, in the units both migration
controllers count in: requests of each kind (prefill steps, decodes), and cores' worth of them.

A CPU core serves about one request of either kind at full speed (the defaults below), so a
core holding ``n`` requests is ``n`` times busy: its steps take ``n`` times as long.
"""

from __future__ import annotations

from banaserve.router.base import Role
from banaserve.router.load import InstanceLoad

#: Decoding requests one core serves at full speed. On a CPU core one: a decode step's time
#: grows about in proportion to its batch there (measured with SmolLM2-135M fp32, RESULTS.md).
DECODE_FULL_REQS = 1.0
#: Prefill steps one core computes at once (a CPU core is busy with one).
PREFILL_FULL_REQS = 1.0
#: Queued prompt tokens on a decode or mixed instance that count as one prefill step.
PREFILL_UNIT_TOKENS = 1024


def work_of(
    load: InstanceLoad, prefill_unit_tokens: int = PREFILL_UNIT_TOKENS
) -> dict[Role, float]:
    """The requests ``load``'s instance holds, by kind of work: all of a prefill instance's
    are prefill steps; a decode or mixed instance's queued prompt tokens count as prefill
    steps (``prefill_unit_tokens`` each, at most its batch) and the rest of its batch as
    decodes. A decode instance holds prompts too: those that spilled there whole when the
    prefill instances were backed up (:mod:`banaserve.router.spill`); counted as decodes, they
    would lend a decode instance's layers to a core that is prefilling."""
    if load.role == Role.PREFILL:
        return {Role.PREFILL: float(load.batch_reqs), Role.DECODE: 0.0}
    prefill = min(load.batch_reqs, load.queued_prefill_tokens / prefill_unit_tokens)
    return {Role.PREFILL: prefill, Role.DECODE: load.batch_reqs - prefill}


def cores_busy(
    load: InstanceLoad,
    decode_full_reqs: float = DECODE_FULL_REQS,
    prefill_full_reqs: float = PREFILL_FULL_REQS,
    prefill_unit_tokens: int = PREFILL_UNIT_TOKENS,
) -> float:
    """Cores' worth of work ``load``'s instance holds (1.0: one core at full speed)."""
    work = work_of(load, prefill_unit_tokens)
    return work[Role.PREFILL] / prefill_full_reqs + work[Role.DECODE] / decode_full_reqs
