"""Attention offload (issue 32): a worker process on a cold core holds part of a hot decode
instance's KV and answers "attention of these queries over that KV" with output and
log-sum-exp, one round trip per layer.

- :mod:`.pool`: the worker's bounded KV pool (a move that does not fit is refused with a reason);
- :mod:`.compute`: attention with its log-sum-exp over what the pool holds;
- :mod:`.wire` and :mod:`.channel`: one message each way per layer, over shared memory with
  eventfd wake-ups (spin first, then block) or a socket;
- :mod:`.worker`: the process (no SGLang), and :mod:`.client`: the hot instance's side, whose
  every wait is bounded so a late answer falls back to local attention.
"""
