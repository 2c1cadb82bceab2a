"""Placement of pages on store shards: a consistent-hashing ring with virtual nodes.

Adding or removing one of n shards moves about 1/n of the keys; virtual nodes keep the load
even. A node is named by its ``host:port`` (not the URL), so reaching the same server over
``tcp://`` or ``shm://`` places keys identically. Immutable after construction, so it is safe
to share between threads.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

DEFAULT_VIRTUAL_NODES = 160


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing over ``nodes`` (distinct strings), ``virtual_nodes`` points each."""

    def __init__(self, nodes: Sequence[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        if not nodes:
            raise ValueError("a hash ring needs at least one node")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"duplicate nodes in {list(nodes)}")
        if virtual_nodes <= 0:
            raise ValueError(f"virtual_nodes must be positive, got {virtual_nodes}")
        self.nodes = tuple(nodes)
        points = sorted(
            (_point(f"{node}#{i}".encode()), index)
            for index, node in enumerate(self.nodes)
            for i in range(virtual_nodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [index for _, index in points]

    def replica_indices(self, key: bytes, r: int) -> list[int]:
        """Indices into ``nodes`` of the ``r`` distinct nodes for ``key``, primary first."""
        if not 0 < r <= len(self.nodes):
            raise ValueError(f"replicas must be in [1, {len(self.nodes)}], got {r}")
        start = bisect.bisect(self._points, _point(key))
        chosen: list[int] = []
        n = len(self._points)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in chosen:
                chosen.append(owner)
                if len(chosen) == r:
                    break
        return chosen

    def replicas(self, key: bytes, r: int) -> list[str]:
        """The ``r`` distinct nodes that hold ``key``, in the order to try them."""
        return [self.nodes[i] for i in self.replica_indices(key, r)]
