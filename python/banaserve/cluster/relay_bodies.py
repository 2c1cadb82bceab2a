"""The bodies the gateway relays for a handoff, and what an instance's reply says it computed.

Handoff through the store (when :mod:`banaserve.router.placement` chooses it): the gateway
first asks a prefill instance for one token of the request, which makes that instance compute
the prompt's KV and write its pages to the store; then it sends the request unchanged to a
decode instance, which finds the prompt's pages in the store (waiting for them if they are
still being written) and only computes the last, partial page before decoding. Any prefill
pairs with any decode: nothing but the store connects them.
"""

from __future__ import annotations

import copy
from typing import Any

from banaserve.api.request_validation import GENERATE


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request as sent to a prefill instance: one token, not streamed, nothing extra
    computed (no logprobs: the decode instance computes what the client asked for)."""
    out = copy.deepcopy(body)
    out["stream"] = False
    if path == GENERATE:
        params = dict(out.get("sampling_params") or {})
        params["max_new_tokens"] = 1
        params.pop("min_new_tokens", None)
        out["sampling_params"] = params
        for key in ("return_logprob", "return_hidden_states", "return_text_in_logprobs"):
            out.pop(key, None)
    else:
        out.pop("max_completion_tokens", None)
        out["max_tokens"] = 1
        out.pop("min_tokens", None)
        out["n"] = 1
        for key in ("logprobs", "top_logprobs", "echo", "stream_options"):
            out.pop(key, None)
    return out


def computed_prompt_tokens(path: str, reply: Any) -> tuple[int, int]:
    """(prompt tokens, prompt tokens served from a cache) from an instance's reply; (0, 0)
    when the reply does not say. Batched ``/generate`` replies are lists: summed."""
    if isinstance(reply, list):
        pairs = [computed_prompt_tokens(path, r) for r in reply]
        return sum(p for p, _ in pairs), sum(c for _, c in pairs)
    if not isinstance(reply, dict):
        return 0, 0
    if path == GENERATE:
        meta = reply.get("meta_info") or {}
        return int(meta.get("prompt_tokens") or 0), int(meta.get("cached_tokens") or 0)
    usage = reply.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0)
