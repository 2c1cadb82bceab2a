"""Attention over split KV: exact merging of partial results computed on disjoint key ranges.

Attention-level migration splits a hot instance's KV by token ranges; each side returns its
partial output with the log-sum-exp of its scores, and `merge_attn_states` recombines them
(`merge_many` for any number of ranges). `partial_attention` computes such a partial, over a token
range and/or whole GQA groups of KV heads, on the CPU or with the CUDA kernel.
"""

from banaserve.attention.merge import merge_attn_states, merge_many
from banaserve.attention.partial import partial_attention

__all__ = ["merge_attn_states", "merge_many", "partial_attention"]
