"""Request bounds and field checks, before any instance sees a request (no processes)."""

from __future__ import annotations

import json

import pytest

from banaserve.api.request_limits import (
    ModelLimits,
    RequestLimits,
    RequestRejected,
    check_content_type,
    json_depth_exceeds,
    parse_json_object,
)
from banaserve.api.request_validation import CHAT, COMPLETIONS, GENERATE, validate_generation

MODEL = ModelLimits(vocab_size=2048, context_length=512, max_token_bytes=8)
LIMITS = RequestLimits(max_body_bytes=1 << 20, max_json_depth=8, max_n=4, max_sequences=8)
HI = [{"role": "user", "content": "Hi"}]


def rejected(path: str, body: dict) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        validate_generation(path, body, MODEL, LIMITS)
    return info.value


def test_only_json_is_accepted() -> None:
    check_content_type("application/json")
    check_content_type("Application/JSON; charset=utf-8")
    for other in ["text/plain", "application/x-www-form-urlencoded", None, ""]:
        with pytest.raises(RequestRejected) as info:
            check_content_type(other)
        assert info.value.status == 415 and "application/json" in info.value.message


def test_body_size_and_depth_are_bounded_with_a_message_naming_the_limit() -> None:
    with pytest.raises(RequestRejected) as info:
        parse_json_object(b'{"text": "' + b"a" * (1 << 20) + b'"}', LIMITS)
    assert info.value.status == 413 and "--max-request-bytes" in info.value.message
    deep = b'{"a": ' + b"[" * 900 + b"]" * 900 + b"}"
    with pytest.raises(RequestRejected) as info:
        parse_json_object(deep, LIMITS)
    assert info.value.status == 400 and "deeper than 8" in info.value.message
    # Brackets inside strings are text, not nesting; escaped quotes do not end a string.
    assert parse_json_object(json.dumps({"t": "[" * 900 + '\\"{'}).encode(), LIMITS)
    assert not json_depth_exceeds(b'{"a": [[[1]]]}', 4) and json_depth_exceeds(b"[[[[[1]]]]]", 4)
    for bad, why in [(b'{"a": ', "not valid JSON"), (b"[1, 2]", "JSON object"),
                     (b"\xff\xfe", "not valid JSON")]:  # fmt: skip
        with pytest.raises(RequestRejected) as info:
            parse_json_object(bad, LIMITS)
        assert info.value.status == 400 and why in info.value.message


def test_depth_counts_nesting_not_brackets() -> None:
    wide = json.dumps({"text": "[{" * 100_000, "x": [[1]] * 10_000, "q": ['a\\"[[[']}).encode()
    assert not json_depth_exceeds(wide, 3)
    assert json_depth_exceeds(json.dumps({"a": [[{"b": [1]}]]}).encode(), 3)


def test_token_ids_must_be_in_the_vocabulary() -> None:
    error = rejected(GENERATE, {"input_ids": [5, 99999999]})
    assert error.status == 400 and "99999999" in error.message and "[0, 2048)" in error.message
    assert "-1" in rejected(GENERATE, {"input_ids": [[1, 2], [3, -1]]}).message
    assert "integer" in rejected(GENERATE, {"input_ids": [1, "2"]}).message
    assert "integer" in rejected(GENERATE, {"input_ids": [1, True]}).message
    assert "2048" in rejected(COMPLETIONS, {"prompt": [1, 2048]}).message
    stop = rejected(COMPLETIONS, {"prompt": "x", "stop_token_ids": [7000]})
    assert stop.param is not None and "stop_token_ids" in stop.param
    logit_bias = rejected(CHAT, {"messages": [], "logit_bias": {"5000": 1.0}})
    assert logit_bias.param == "logit_bias" and "5000" in logit_bias.message
    wanted = rejected(GENERATE, {"text": "x", "token_ids_logprob": [4096]})
    assert "token_ids_logprob" in wanted.message
    params = {"text": "x", "sampling_params": {"stop_token_ids": [1, 2, 3000]}}
    assert "sampling_params.stop_token_ids" in rejected(GENERATE, params).message
    for fine in [{"input_ids": [0, 2047]}, {"input_ids": [[1], [2, 3]]}, {"text": "hello"}]:
        validate_generation(GENERATE, fine, MODEL, LIMITS)
    validate_generation(COMPLETIONS, {"prompt": [[1, 2], [3]], "logit_bias": {"7": -1}},
                        MODEL, LIMITS)  # fmt: skip


def test_prompts_must_fit_the_context() -> None:
    error = rejected(GENERATE, {"input_ids": list(range(512))})
    assert "(512 tokens) is longer than the model's context length (512 tokens)" in error.message
    # 8 bytes per token at most: 4096 bytes are at least 512 tokens, refused untokenised.
    assert "at least 512 tokens" in rejected(GENERATE, {"text": "a" * 4096}).message
    assert "context length" in rejected(COMPLETIONS, {"prompt": ["ok", "b" * 5000]}).message
    messages = [{"role": "user", "content": [{"type": "text", "text": "c" * 5000}]}]
    assert "context length" in rejected(CHAT, {"messages": messages}).message
    validate_generation(GENERATE, {"text": "a" * 4000}, MODEL, LIMITS)


def test_n_is_bounded_and_sampling_parameters_in_range() -> None:
    assert "--max-request-n" in rejected(COMPLETIONS, {"prompt": "x", "n": 2000}).message
    assert "best_of" in rejected(COMPLETIONS, {"prompt": "x", "best_of": 5}).message
    assert "n must be" in rejected(GENERATE, {"text": "x", "sampling_params": {"n": 0}}).message
    batch = {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 9}]}
    assert "sampling_params[1].n" in rejected(GENERATE, batch).message
    for name, value in [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("min_p", 2),
                        ("frequency_penalty", 3), ("repetition_penalty", 0),
                        ("max_tokens", -5), ("temperature", float("nan"))]:  # fmt: skip
        error = rejected(CHAT, {"messages": [], name: value})
        assert error.param == name and name in error.message, (name, value)
    assert "top_k" in rejected(GENERATE, {"text": "x", "sampling_params": {"top_k": 0}}).message
    ok = {"temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "n": 4, "max_new_tokens": 0}
    validate_generation(GENERATE, {"text": "x", "sampling_params": ok}, MODEL, LIMITS)
    # Other types are SGLang's to refuse (its OpenAI models coerce "0.5").
    validate_generation(CHAT, {"messages": HI, "temperature": "0.5"}, MODEL, LIMITS)


def test_what_a_request_asks_for_is_bounded_by_value() -> None:
    """Each bound refuses with a 400 naming the field (issue 31: a bias of 1e308 was accepted,
    a 2,048-wide top_logprobs_num made a 38 MiB answer)."""
    cases = [
        (CHAT, {"messages": HI, "logit_bias": {"5": 1e308}}, "logit_bias", "[-100, 100]"),
        (GENERATE, {"text": "x", "sampling_params": {"logit_bias": {"5": -101}}}, "logit_bias",
         "sampling_params.logit_bias[5]"),
        (CHAT, {"messages": HI, "stop": ["s"] * 65}, "stop", "65 strings"),
        (COMPLETIONS, {"prompt": "x", "stop": "s" * 1025}, "stop", "1024 characters"),
        (GENERATE, {"text": "x", "top_logprobs_num": 2048}, "top_logprobs_num", "[0, 20]"),
        (GENERATE, {"text": ["x", "y"], "top_logprobs_num": [1, 21]}, "top_logprobs_num", "21"),
        (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 50}, "logprobs", "[0, 20]"),
        (GENERATE, {"text": "x", "sampling_params": {"regex": "a" * 70_000}}, "regex", "65536"),
        (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"enum": ["v" * 70_000]}}}}, "response_format", "bytes"),
        (GENERATE, {"text": "x", "sampling_params": {"max_new_tokens": 1e308}},
         "max_new_tokens", "integer"),
        (GENERATE, {"text": "x", "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens",
         "integer"),
        (CHAT, {"messages": HI, "max_tokens": 2**40}, "max_tokens", "integer"),
        (GENERATE, {"text": "x", "logprob_start_len": 512}, "logprob_start_len", "[-1, 512)"),
        (GENERATE, {"text": "x", "logprob_start_len": -2}, "logprob_start_len", "-2"),
        (GENERATE, {"text": ""}, "text", "empty"),
        (GENERATE, {"input_ids": []}, "input_ids", "empty"),
        (GENERATE, {"text": ["ok", ""]}, "text", "text[1] is empty"),
        (COMPLETIONS, {"prompt": ""}, "prompt", "empty"),
        (CHAT, {"messages": []}, "messages", "empty"),
        (GENERATE, {"text": ["x"] * 3, "sampling_params": {"n": 3}}, "n", "9 sequences"),
        (GENERATE, {"input_ids": [[1]] * 9}, "n", "--max-request-sequences"),
        (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 3}, "n", "3 prompts x n=3"),
    ]  # fmt: skip
    for path, body, param, words in cases:
        error = rejected(path, body)
        assert error.status == 400 and error.param == param and words in error.message, body
    fine = [
        (CHAT, {"messages": HI, "logit_bias": {"5": 100, "6": -100}, "stop": ["a"] * 64,
                "top_logprobs": 20, "max_tokens": 2**31 - 1, "n": 4}),
        (GENERATE, {"text": ["x"] * 4, "sampling_params": {"n": 2, "max_new_tokens": 8},
                    "top_logprobs_num": 20, "logprob_start_len": -1}),
        (GENERATE, {"input_ids": [[1]] * 8, "logprob_start_len": 511}),
        (COMPLETIONS, {"prompt": [[1, 2], [3]], "n": 4, "logprobs": 5, "max_tokens": "5"}),
    ]  # fmt: skip
    for path, body in fine:
        validate_generation(path, body, MODEL, LIMITS)


def test_each_prompt_of_a_batch_is_checked_against_the_context_alone() -> None:
    """Issue 31: a batch of eight 450-token prompts on a 2,048-token model was refused, its
    prompts counted as one joined text."""
    from banaserve.cluster.intake import admit

    model = ModelLimits(vocab_size=2048, context_length=2048, max_token_bytes=64)
    words = len  # one token per character, for the test

    def raw(body: dict) -> bytes:
        return json.dumps(body).encode()

    batch = {"text": ["w" * 450] * 8, "sampling_params": {"max_new_tokens": 1}}
    admitted = admit(GENERATE, raw(batch), RequestLimits(), model, words)
    assert admitted.shape.prompt_tokens == 3600 and admitted.shape.longest_prompt_tokens == 450
    ids = {"input_ids": [[1] * 450] * 8}
    assert admit(GENERATE, raw(ids), RequestLimits(), model, words).shape.prompt_tokens == 3600
    completions = {"prompt": ["w" * 450] * 8, "max_tokens": 1}
    admit(COMPLETIONS, raw(completions), RequestLimits(), model, words)
    with pytest.raises(RequestRejected) as info:
        admit(GENERATE, raw({"text": ["w" * 10, "w" * 2048]}), RequestLimits(), model, words)
    assert "(2048 tokens) is longer than the model's context length" in info.value.message
