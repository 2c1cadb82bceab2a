"""Attention over split KV: exact merging of partial results computed on disjoint key ranges.

Attention-level migration splits a hot instance's KV by token ranges; each side returns its
partial output with the log-sum-exp of its scores, and `merge_attn_states` recombines them.
"""

from banaserve.attention.merge import merge_attn_states

__all__ = ["merge_attn_states"]
