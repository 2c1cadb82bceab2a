"""The approximate radix tree over request text that sglang-router's ``cache_aware`` policy keeps
per worker, and that the gateway's prompt index (:mod:`banaserve.router.placement`) reuses.

Text, not tokens: no tokenizer sits on the routing path. A tree's size is its character count;
least recently used leaves go first, by a logical clock the caller passes in.
"""

from __future__ import annotations

import heapq
import itertools


def common_prefix_len(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    # Binary search on slice equality: C-speed comparisons instead of a per-character loop,
    # which matters for prompts of many thousand characters. Invariant: a[:lo] == b[:lo],
    # a[:hi] != b[:hi].
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("text", "children", "parent", "last_access")

    def __init__(self, text: str, parent: _Node | None, last_access: int) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.last_access = last_access


class ApproxRadixTree:
    """One worker's approximate prefix cache: a radix tree over request text, LRU by leaf.

    ``size`` is the number of characters stored (the sum of edge lengths). Not thread-safe:
    :class:`CacheAwarePolicy` holds its lock around every call.
    """

    def __init__(self) -> None:
        self._root = _Node("", None, 0)
        self.size = 0

    def match_len(self, text: str) -> int:
        """Characters of ``text``'s longest prefix stored in the tree (partial edges count)."""
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            shared = common_prefix_len(child.text, text[i:])
            i += shared
            if shared < len(child.text):
                break
            node = child
        return i

    def insert(self, text: str, stamp: int) -> None:
        """Store ``text``, marking every node on its path as used at logical time ``stamp``."""
        node, i = self._root, 0
        node.last_access = stamp
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, stamp)
                node.children[text[i]] = leaf
                self.size += len(leaf.text)
                return
            shared = common_prefix_len(child.text, text[i:])
            if shared < len(child.text):
                # Split the edge: node -> mid(shared part) -> child(rest). Size is unchanged.
                mid = _Node(child.text[:shared], node, child.last_access)
                child.text = child.text[shared:]
                child.parent = mid
                mid.children[child.text[0]] = child
                node.children[text[i]] = mid
                child = mid
            child.last_access = stamp
            node = child
            i += shared

    def evict_to(self, max_size: int) -> int:
        """Drop least recently used leaves until ``size <= max_size``; returns chars dropped."""
        if self.size <= max_size:
            return 0
        order = itertools.count()  # tie-break so the heap never compares nodes
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self._root:
                heap.append((node.last_access, next(order), node))
        heapq.heapify(heap)
        dropped = 0
        while self.size > max_size and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.text[0]]
            self.size -= len(leaf.text)
            dropped += len(leaf.text)
            if not parent.children and parent is not self._root:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return dropped
