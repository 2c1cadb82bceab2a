"""Which shard each key of a call goes to, round after round: its replicas in ring order,
skipping those that are down, each tried at most once per call."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from banaserve.kvstore.sharding import HashRing


class ReplicaRounds:
    """The replicas of a call's keys and how far each key got through them.

    Round k sends every key still pending to its next live replica, one batch per shard; a
    key whose shard did not serve it (down, or a miss where another replica may have it)
    goes round again while it has replicas left. Confined to the calling thread.
    """

    def __init__(self, ring: HashRing, keys: list[bytes], replication: int) -> None:
        self._replicas = [ring.replica_indices(key, replication) for key in keys]
        self._tried = [0] * len(keys)

    def next_round(
        self, pending: Iterable[int], live: Callable[[int], bool]
    ) -> dict[int, list[int]]:
        """Shard -> the keys (indices, in ``pending``'s order) it is asked this round; a key
        with no live replica left is in none."""
        groups: dict[int, list[int]] = defaultdict(list)
        for i in pending:
            order = self._replicas[i]
            while self._tried[i] < len(order) and not live(order[self._tried[i]]):
                self._tried[i] += 1
            if self._tried[i] < len(order):
                groups[order[self._tried[i]]].append(i)
                self._tried[i] += 1
        return groups

    def left(self, i: int) -> bool:
        """Whether key ``i`` has replicas not tried yet."""
        return self._tried[i] < len(self._replicas[i])


def live_replicas(
    ring: HashRing,
    keys: list[bytes],
    replication: int,
    live: Callable[[int], bool],
    *,
    first_only: bool,
) -> dict[int, list[int]]:
    """Shard -> the keys (indices) it holds a replica of, among live shards only: every live
    replica of a key (a write), or its first live one (``first_only``)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        for s in ring.replica_indices(key, replication):
            if live(s):
                groups[s].append(i)
                if first_only:
                    break
    return groups
