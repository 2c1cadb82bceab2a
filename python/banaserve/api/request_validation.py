"""Checks on a generation request's fields, before any SGLang instance sees it.

SGLang validates most sampling parameters itself (with a 400), but not everything: a token id
outside ``[0, vocab)`` in ``input_ids`` or a completions ``prompt`` reaches the model's
embedding and kills the instance's scheduler. These checks refuse, with a 400 that names the
field, whatever would crash an instance or make it do unbounded work: token ids out of the
vocabulary (prompts, ``stop_token_ids``, ``logit_bias``, ``token_ids_logprob``), prompts that
cannot fit the context, ``n`` above the operator's bound, and numeric sampling parameters out
of the ranges SGLang's ``SamplingParams.verify`` states (so the gateway answers at once what an
instance would answer anyway). Values of another type than the check expects are left to
SGLang's own parsing (its OpenAI models coerce ``"0.5"``), except token ids, which must be
integers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from banaserve.api.request_limits import (
    ModelLimits,
    RequestLimits,
    RequestRejected,
    is_int,
    is_number,
)
from banaserve.api.value_bounds import check_native, check_openai

GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATION_PATHS = (GENERATE, COMPLETIONS, CHAT)


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval a numeric parameter must lie in."""

    low: float
    high: float = math.inf
    low_open: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return math.isfinite(value) and above and value <= self.high

    def describe(self) -> str:
        high = "inf)" if math.isinf(self.high) else f"{self.high:g}]"
        return f"{'(' if self.low_open else '['}{self.low:g}, {high}"


#: SGLang's ``SamplingParams.verify`` ranges, under the native and the OpenAI names.
SAMPLING_RANGES: dict[str, Range] = {
    "temperature": Range(0.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "min_p": Range(0.0, 1.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "presence_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 2.0, low_open=True),
}
#: Fields that count completions; each must be an integer in ``[1, limits.max_n]``.
N_FIELDS = ("n", "best_of")


def check_sampling(params: Any, where: str, limits: RequestLimits) -> None:
    """Numeric ranges, ``top_k`` and ``n`` of one parameter map (native or OpenAI names)."""
    if not isinstance(params, dict):
        return  # SGLang refuses a non-object itself
    for name, allowed in SAMPLING_RANGES.items():
        value = params.get(name)
        if is_number(value) and not allowed.holds(value):
            raise RequestRejected(
                400, f"{where}{name} must be in {allowed.describe()}, got {value}.", name
            )
    top_k = params.get("top_k")
    if is_int(top_k) and top_k != -1 and top_k < 1:
        raise RequestRejected(400, f"{where}top_k must be -1 (off) or at least 1, got {top_k}.")
    for name in N_FIELDS:
        value = params.get(name)
        if value is None:
            continue
        if not is_int(value) or not 1 <= value <= limits.max_n:
            raise RequestRejected(
                400,
                f"{where}{name} must be an integer in [1, {limits.max_n}] (--max-request-n), "
                f"got {value!r}.",
                name,
            )


def check_token_ids(ids: Any, name: str, model: ModelLimits, *, prompt: bool) -> None:
    """A flat list of integer ids in ``[0, vocab)``; a prompt must also fit the context."""
    if not isinstance(ids, list) or not all(is_int(i) for i in ids):
        raise RequestRejected(400, f"{name} must be a list of integer token ids.", name)
    if prompt and len(ids) >= model.context_length:
        raise RequestRejected(400, too_long_message(len(ids), model), name)
    wrong = vocabulary_error(ids, name, model.vocab_size)
    if wrong is not None:
        raise RequestRejected(400, wrong, name)


def vocabulary_error(ids: list[int], name: str, vocab_size: int) -> str | None:
    """What is wrong with the integer ids ``ids`` if one is outside ``[0, vocab_size)``."""
    if not ids or 0 <= min(ids) and max(ids) < vocab_size:
        return None
    bad = next(i for i in ids if not 0 <= i < vocab_size)
    return f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})."


def too_long_message(tokens: int, model: ModelLimits, at_least: bool = False) -> str:
    """SGLang's wording, so a client sees one message whoever refuses."""
    count = f"at least {tokens}" if at_least else str(tokens)
    return (
        f"The input ({count} tokens) is longer than the model's context length "
        f"({model.context_length} tokens)."
    )


def check_text_length(text: str, name: str, model: ModelLimits) -> None:
    """Refuse a text that has more tokens than the context from its size alone."""
    size = len(text.encode("utf-8", "surrogatepass"))
    fewest_tokens = size // model.max_token_bytes
    if fewest_tokens >= model.context_length:
        raise RequestRejected(400, too_long_message(fewest_tokens, model, at_least=True), name)


def _ids_or_batch(value: Any, name: str, model: ModelLimits) -> None:
    """``[ids...]`` or ``[[ids...], ...]`` (a batch)."""
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        for i, ids in enumerate(value):
            check_token_ids(ids, f"{name}[{i}]", model, prompt=True)
    else:
        check_token_ids(value, name, model, prompt=True)


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        yield from (v for v in value if isinstance(v, str))


def _check_logit_bias(params: Any, where: str, model: ModelLimits) -> None:
    bias = params.get("logit_bias") if isinstance(params, dict) else None
    if not isinstance(bias, dict):
        return
    for key in bias:
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestRejected(
                400, f"{where}logit_bias keys must be token ids, got {key!r}.", "logit_bias"
            ) from None
        if not 0 <= token < model.vocab_size:
            raise RequestRejected(
                400,
                f"{where}logit_bias names token id {token}, outside the vocabulary "
                f"[0, {model.vocab_size}).",
                "logit_bias",
            )


def _check_common(params: Any, where: str, model: ModelLimits, limits: RequestLimits) -> None:
    """What native sampling params and OpenAI bodies share: ranges, stop ids, logit bias."""
    check_sampling(params, where, limits)
    if isinstance(params, dict) and params.get("stop_token_ids") is not None:
        check_token_ids(params["stop_token_ids"], f"{where}stop_token_ids", model, prompt=False)
    _check_logit_bias(params, where, model)


def _check_generate(body: dict[str, Any], model: ModelLimits, limits: RequestLimits) -> None:
    if body.get("input_ids") is not None:
        _ids_or_batch(body["input_ids"], "input_ids", model)
    for text in _texts(body.get("text")):
        check_text_length(text, "text", model)
    params = body.get("sampling_params")
    for i, one in enumerate(params if isinstance(params, list) else [params]):
        _check_common(one, "sampling_params." if params is one else f"sampling_params[{i}].",
                      model, limits)  # fmt: skip
    wanted = body.get("token_ids_logprob")
    if wanted is not None:
        batch = isinstance(wanted, list) and wanted and all(isinstance(w, list) for w in wanted)
        for ids in wanted if batch else [wanted]:
            check_token_ids(ids, "token_ids_logprob", model, prompt=False)


def _check_openai(path: str, body: dict[str, Any], model: ModelLimits,
                  limits: RequestLimits) -> None:  # fmt: skip
    _check_common(body, "", model, limits)
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(p, str) for p in prompt):
            _ids_or_batch(prompt, "prompt", model)
        for text in _texts(prompt):
            check_text_length(text, "prompt", model)
        return
    messages = body.get("messages")
    if isinstance(messages, list):
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in message_texts(messages))
        if size // model.max_token_bytes >= model.context_length:
            fewest = size // model.max_token_bytes
            raise RequestRejected(400, too_long_message(fewest, model, at_least=True), "messages")


def message_texts(messages: list[Any]) -> Iterator[str]:
    """The text parts of chat messages: string contents and ``{"type": "text"}`` parts."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


def validate_generation(
    path: str, body: dict[str, Any], model: ModelLimits, limits: RequestLimits
) -> None:
    """Raise :class:`RequestRejected` (400) if ``body`` must not reach an instance: the checks
    above, then the bounds by value of :mod:`banaserve.api.value_bounds`."""
    if path == GENERATE:
        _check_generate(body, model, limits)
        check_native(body, model, limits)
    elif path in (COMPLETIONS, CHAT):
        _check_openai(path, body, model, limits)
        check_openai(path == CHAT, body, limits)
