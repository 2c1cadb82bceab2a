"""What the gateway counts: requests by how they were served, failures, and how much of a
conversation's next turn the cluster found cached; shown by ``/cluster`` and ``/metrics``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GatewayCounters:
    """Monotonic counts of what the gateway did, for ``/cluster`` and ``/metrics``; written
    on the gateway's event loop only."""

    requests: int = 0
    handoffs: int = 0
    direct: int = 0
    direct_on_prefill: int = 0
    long_on_prefill: int = 0  # of those, longer than in-place: the prefill cores were spare
    followed: int = 0
    spilled: int = 0  # needed a handoff, ran whole: prefill backed up, or a spare one
    retries: int = 0
    errors: int = 0
    fallbacks_to_prefill: int = 0
    rejected: int = 0  # refused by the intake (4xx)
    intake_busy: int = 0
    deaths_while_serving: int = 0
    quarantined: int = 0  # requests answered 500 at their second instance death
    quarantine_refusals: int = 0
    follow_up_turns: int = 0  # chat requests with an answer in their history
    follow_up_reported: int = 0  # of those, whose reply said how many prompt tokens were cached
    follow_up_prompt_tokens: int = 0  # (of the reported ones; a handoff's by its prefill step)
    follow_up_cached_tokens: int = 0
    started_at: float = field(default_factory=time.time)

    def follow_up(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A conversation's next turn's reply reported its prompt and cached tokens."""
        self.follow_up_reported += 1
        self.follow_up_prompt_tokens += prompt_tokens
        self.follow_up_cached_tokens += cached_tokens


def multi_turn_state(counters: GatewayCounters) -> dict[str, Any]:
    """How much of a conversation's next turn the cluster found cached (``/cluster``)."""
    prompt, cached = counters.follow_up_prompt_tokens, counters.follow_up_cached_tokens
    return {
        "follow_up_turns": counters.follow_up_turns,
        "reported": counters.follow_up_reported,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
    }
