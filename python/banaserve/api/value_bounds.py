"""Bounds on what a generation request asks for, by value: what SGLang accepts but should not.

:mod:`banaserve.api.request_validation` checks types and SGLang's own ranges; these checks
bound the work and the answer one request may cause, each with a 400 that names the field and
the bound (:class:`~banaserve.api.request_limits.RequestLimits`):

- ``logit_bias`` values finite and within ``max_logit_bias``;
- ``stop`` strings at most ``max_stop_strings``, each at most ``max_stop_chars`` long;
- ``top_logprobs_num`` / ``top_logprobs`` / ``logprobs`` at most ``max_top_logprobs`` (a
  2,048-wide answer per token made one request a 38 MiB reply);
- ``regex``, ``ebnf``, ``json_schema``, ``structural_tag`` and ``response_format`` at most
  ``max_grammar_bytes`` each (compiled per request);
- token counts (``max_new_tokens``, ``max_tokens``, ...), when numbers, integers in
  ``[0, 2**31)``, and
  ``logprob_start_len`` an integer in ``[-1, context)``;
- no empty prompt (an empty text, id list or message list);
- a batch's prompts times ``n`` at most ``max_sequences``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from banaserve.api.request_limits import (
    ModelLimits,
    RequestLimits,
    RequestRejected,
    is_int,
    is_number,
)

#: Token counts are int32 in SGLang's scheduler tensors.
MAX_TOKEN_COUNT = 2**31 - 1
TOKEN_COUNT_FIELDS = ("max_new_tokens", "min_new_tokens", "max_tokens",
                      "max_completion_tokens", "min_tokens")  # fmt: skip
GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema", "structural_tag", "response_format")


def _refuse(message: str, param: str) -> RequestRejected:
    return RequestRejected(400, message, param)


def check_params(params: Any, where: str, limits: RequestLimits) -> None:
    """The by-value bounds of one parameter map: native ``sampling_params`` or an OpenAI body."""
    if not isinstance(params, dict):
        return
    bias = params.get("logit_bias")
    if isinstance(bias, dict):
        for token, value in bias.items():
            if is_number(value) and not (
                math.isfinite(value) and abs(value) <= limits.max_logit_bias
            ):
                raise _refuse(
                    f"{where}logit_bias[{token}] must be in [-{limits.max_logit_bias:g}, "
                    f"{limits.max_logit_bias:g}], got {value}.", "logit_bias",
                )  # fmt: skip
    stop = params.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > limits.max_stop_strings:
        raise _refuse(f"{where}stop holds {len(stops)} strings; at most "
                      f"{limits.max_stop_strings} are accepted.", "stop")  # fmt: skip
    for one in stops:
        if isinstance(one, str) and len(one) > limits.max_stop_chars:
            raise _refuse(f"{where}stop strings may be at most {limits.max_stop_chars} "
                          f"characters long, got {len(one)}.", "stop")  # fmt: skip
    for name in GRAMMAR_FIELDS:
        value = params.get(name)
        if value is None:
            continue
        size = (
            len(value.encode("utf-8", "surrogatepass"))
            if isinstance(value, str)
            else len(json.dumps(value).encode())
        )
        if size > limits.max_grammar_bytes:
            raise _refuse(f"{where}{name} is {size} bytes, over the limit of "
                          f"{limits.max_grammar_bytes} bytes.", name)  # fmt: skip
    for name in TOKEN_COUNT_FIELDS:
        value = params.get(name)
        if not is_number(value):
            continue  # SGLang parses a string itself (its OpenAI models coerce "5")
        if not is_int(value) or not 0 <= value <= MAX_TOKEN_COUNT:
            raise _refuse(f"{where}{name} must be an integer in [0, {MAX_TOKEN_COUNT}], "
                          f"got {value!r}.", name)  # fmt: skip


def check_top_logprobs(value: Any, name: str, limits: RequestLimits) -> None:
    """``value`` (an int, or a list of them for a batch) in ``[0, max_top_logprobs]``."""
    for one in value if isinstance(value, list) else [value]:
        if is_int(one) and not 0 <= one <= limits.max_top_logprobs:
            raise _refuse(f"{name} must be in [0, {limits.max_top_logprobs}], got {one}.", name)


def check_logprob_start(value: Any, model: ModelLimits) -> None:
    for one in value if isinstance(value, list) else [value]:
        if one is None:
            continue
        if not is_int(one) or not -1 <= one < model.context_length:
            raise _refuse(
                f"logprob_start_len must be an integer in [-1, {model.context_length}), "
                f"got {one!r}.", "logprob_start_len",
            )  # fmt: skip


def prompts_of(value: Any) -> list[Any]:
    """A prompt field as a list of prompts: a batch (a list of texts or of id lists) or one."""
    if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
            return list(value)
    return [value]


def check_not_empty(prompts: list[Any], name: str) -> None:
    for i, prompt in enumerate(prompts):
        if prompt == "" or prompt == []:
            where = name if len(prompts) == 1 else f"{name}[{i}]"
            raise _refuse(f"{where} is empty: there is nothing to generate from.", name)


def _n_values(params: Any) -> Iterator[int]:
    for one in params if isinstance(params, list) else [params]:
        n = one.get("n") if isinstance(one, dict) else None
        yield n if is_int(n) and n > 0 else 1


def check_sequences(prompts: int, n: int, limits: RequestLimits) -> None:
    if prompts * n > limits.max_sequences:
        raise _refuse(
            f"The request asks for {prompts} prompts x n={n} = {prompts * n} sequences, over "
            f"the limit of {limits.max_sequences} (--max-request-sequences).", "n",
        )  # fmt: skip


def check_native(body: dict[str, Any], model: ModelLimits, limits: RequestLimits) -> None:
    """``/generate``'s body (and the native bodies of ``/encode``, ``/classify``)."""
    params = body.get("sampling_params")
    for i, one in enumerate(params if isinstance(params, list) else [params]):
        check_params(one, "sampling_params." if params is one else f"sampling_params[{i}].",
                     limits)  # fmt: skip
    check_top_logprobs(body.get("top_logprobs_num"), "top_logprobs_num", limits)
    check_logprob_start(body.get("logprob_start_len"), model)
    key = "input_ids" if body.get("input_ids") is not None else "text"
    if body.get(key) is None:
        return  # input_embeds, or nothing: SGLang answers
    prompts = prompts_of(body[key])
    check_not_empty(prompts, key)
    check_sequences(len(prompts), max(_n_values(params)), limits)


def check_openai(path_is_chat: bool, body: dict[str, Any], limits: RequestLimits) -> None:
    """An OpenAI completions or chat body."""
    check_params(body, "", limits)
    n = body.get("n")
    n = n if is_int(n) and n > 0 else 1
    if path_is_chat:
        check_top_logprobs(body.get("top_logprobs"), "top_logprobs", limits)
        messages = body.get("messages")
        if messages == []:
            raise _refuse("messages is empty: there is nothing to generate from.", "messages")
        check_sequences(1, n, limits)
        return
    check_top_logprobs(body.get("logprobs"), "logprobs", limits)
    prompts = prompts_of(body.get("prompt"))
    check_not_empty(prompts, "prompt")
    check_sequences(len(prompts), n, limits)
