"""What the router needs to know about a request: :class:`RequestShape`, read from a body that
the intake has already validated (:mod:`banaserve.api.request_validation`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from banaserve.api.request_validation import CHAT, COMPLETIONS, GENERATE, message_texts
from banaserve.api.value_bounds import prompts_of

#: Without a tokenizer: about four characters per token for English text.
CHARS_PER_TOKEN = 4
#: What a request that does not say how many tokens it generates is booked as: SGLang's own
#: default ``max_new_tokens`` (``SamplingParams``, sglang 0.5.23).
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class RequestShape:
    """A generation request as the router sees it."""

    path: str
    prompt: str  # the text the cache-aware policy matches on
    prompt_tokens: int  # estimated
    stream: bool
    max_new_tokens: int | None  # None: the server's default
    prior_turns: int = 0  # a chat's assistant messages: > 0 for a conversation's next turn
    longest_prompt_tokens: int = 0  # of a batch's prompts, each of which must fit the context

    @property
    def decode_tokens(self) -> int:
        """The most tokens it may generate: what its serve step is booked as."""
        return DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens


def _text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text_of(v) for v in value)
    if isinstance(value, dict):
        return _text_of(value.get("text") or value.get("content") or "")
    return ""


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The prompt as text for prefix matching; token ids (``input_ids``, a completions prompt
    of ids) as their decimal string, so equal id prefixes still match."""
    if path == CHAT:
        messages = body.get("messages")
        return "\n".join(message_texts(messages)) if isinstance(messages, list) else ""
    key, ids_key = ("prompt", "prompt") if path == COMPLETIONS else ("text", "input_ids")
    text = _text_of(body.get(key))
    if not text and _token_count_of_ids(body, ids_key) is not None:
        text = repr(body[ids_key])
    return text


def _token_count_of_ids(body: dict[str, Any], key: str) -> int | None:
    ids = body.get(key)
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        return len(ids)
    if isinstance(ids, list) and ids and all(isinstance(i, list) for i in ids):
        return sum(len(i) for i in ids)
    return None


def prior_turns_of(path: str, body: dict[str, Any]) -> int:
    """How many answers a chat request's history holds (its ``assistant`` messages): the
    turns of the conversation before this one."""
    messages = body.get("messages") if path == CHAT else None
    if not isinstance(messages, list):
        return 0
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def max_new_tokens_of(path: str, body: dict[str, Any]) -> int | None:
    if path == GENERATE:
        params = body.get("sampling_params")
        value = params.get("max_new_tokens") if isinstance(params, dict) else None
    else:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _batch_lengths(path: str, body: dict[str, Any], count: Callable[[str], int]) -> list[int]:
    """The token count of each prompt of a batch (empty for one prompt or a chat)."""
    if path == CHAT:
        return []
    key = "prompt" if path == COMPLETIONS else "text"
    if path == GENERATE and body.get("input_ids") is not None:
        key = "input_ids"
    prompts = prompts_of(body.get(key))
    if len(prompts) < 2:
        return []
    return [len(p) if isinstance(p, list) else count(p) for p in prompts]


def shape_request(
    path: str, body: dict[str, Any], count_tokens: Callable[[str], int] | None = None
) -> RequestShape:
    count = count_tokens or (lambda text: len(text) // CHARS_PER_TOKEN)
    text = prompt_text(path, body)
    lengths = _batch_lengths(path, body, count)
    key = "input_ids" if path == GENERATE else "prompt"
    tokens = sum(lengths) if lengths else _token_count_of_ids(body, key)
    if tokens is None:
        tokens = count(text)
    return RequestShape(
        path=path,
        prompt=text,
        prompt_tokens=tokens,
        stream=bool(body.get("stream", False)),
        max_new_tokens=max_new_tokens_of(path, body),
        prior_turns=prior_turns_of(path, body),
        longest_prompt_tokens=max(lengths) if lengths else tokens,
    )
