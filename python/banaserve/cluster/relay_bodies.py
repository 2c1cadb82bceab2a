"""The bodies the gateway relays for a handoff, and what an instance's reply (whole or streamed)
says it computed.

Handoff through the store (when :mod:`banaserve.router.placement` chooses it): the gateway
first asks a prefill instance for one token of the request, which makes that instance compute
the prompt's KV and write its pages to the store; then it sends the request unchanged to a
decode instance, which finds the prompt's pages in the store (waiting for them if they are
still being written) and only computes the last, partial page before decoding. Any prefill
pairs with any decode: nothing but the store connects them.
"""

from __future__ import annotations

import copy
import json
from collections import deque
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


def whole_reply_prompt_tokens(path: str, data: bytes) -> tuple[int, int]:
    """:func:`computed_prompt_tokens` of a whole (not streamed) reply; (0, 0) if not JSON."""
    try:
        return computed_prompt_tokens(path, json.loads(data))
    except ValueError:
        return 0, 0


#: The end of a stream kept to read its prompt-token counts from: the last event of a streamed
#: ``/generate`` (cumulative text and meta info) or a chat's usage chunk fits, unless the
#: client asked for logprobs or a very long answer (then nothing is booked for it).
STREAM_TAIL_BYTES = 64 * 1024


#: The event that ends an SGLang (and OpenAI) server-sent-event stream.
STREAM_END = b"data: [DONE]"


class StreamTail:
    """The last ``limit`` bytes (about) of a server-sent-event stream, as chunks; one relay's,
    on the gateway's event loop."""

    def __init__(self, limit: int = STREAM_TAIL_BYTES) -> None:
        self.limit = limit
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._end = b""  # the stream's last bytes, across chunk boundaries

    @property
    def ended(self) -> bool:
        """Whether the stream's last event so far is its end (``data: [DONE]``)."""
        return self._end.rstrip().endswith(STREAM_END)

    def add(self, chunk: bytes) -> None:
        self._end = (self._end + chunk)[-len(STREAM_END) - 8 :]
        self._chunks.append(chunk)
        self._size += len(chunk)
        while len(self._chunks) > 1 and self._size - len(self._chunks[0]) >= self.limit:
            self._size -= len(self._chunks.popleft())

    @property
    def size(self) -> int:
        """Bytes kept: under ``limit`` plus the newest chunk."""
        return self._size

    def prompt_tokens(self, path: str) -> tuple[int, int]:
        """:func:`computed_prompt_tokens` of the last event that says them ((0, 0) if none
        does: a chat stream reports usage only when its client asks, ``include_usage``)."""
        events = b"".join(self._chunks).split(b"\n")
        for line in reversed(events):
            line = line.strip()
            if not line.startswith(b"data:") or line == STREAM_END:
                continue
            try:
                counts = computed_prompt_tokens(path, json.loads(line[5:]))
            except ValueError:  # the tail began mid-event
                continue
            if counts[0]:
                return counts
        return 0, 0
