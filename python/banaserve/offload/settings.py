"""The offload of one instance: what moves, how much room the worker has, how long a layer
waits for it; every default named once. Pure (no torch), so the platform's import hook can
read it before anything heavy is imported."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

#: Seconds an offload call waits for its answer before the caller falls back. A layer's
#: attention takes milliseconds (benchmark/offload_roundtrip.py: p99 about 4 ms on busy cores,
#: the scheduler's slice), so this only catches a stuck worker.
TIMEOUT_S = 0.5
#: Contexts at least this long move to the worker. A judgement, not a measurement: below a
#: few hundred tokens a layer's attention takes less than the round trip (50 us at p50).
MIN_TOKENS = 256
#: Tokens reserved on the worker past a sequence's length at its move; a part that fills up
#: is served by the instance again (and may move again, with new room).
HEADROOM_TOKENS = 512
#: The worker's KV budget.
POOL_MIB = 1024
TRANSPORTS = ("shm", "socket")


@dataclass(frozen=True)
class OffloadSettings:
    """``cores``: where the worker runs (none: anywhere); ``pool_mib``: its KV budget;
    ``min_tokens`` and ``headroom_tokens``: what moves and with how much room;
    ``transport``: ``shm`` or ``socket``; ``timeout_s``: a layer's longest wait."""

    cores: tuple[int, ...] = ()
    pool_mib: int = POOL_MIB
    min_tokens: int = MIN_TOKENS
    headroom_tokens: int = HEADROOM_TOKENS
    transport: str = "shm"
    timeout_s: float = TIMEOUT_S

    def __post_init__(self) -> None:
        if min(self.pool_mib, self.min_tokens, self.headroom_tokens) < 1 or self.timeout_s <= 0:
            raise ValueError(f"offload settings out of range: {self}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")

    @classmethod
    def from_json(cls, raw: str) -> OffloadSettings:
        """Settings from a JSON object of these fields; ``ValueError`` naming what is wrong."""
        values = json.loads(raw)
        if not isinstance(values, dict):
            raise ValueError(f"offload settings must be a JSON object, got {raw!r}")
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown offload settings {sorted(unknown)}")
        return cls(**{**values, "cores": tuple(int(c) for c in values.get("cores", ()))})

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})
