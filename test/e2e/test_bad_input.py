"""Bad requests get a 4xx that says what is wrong, and the server keeps serving."""

from __future__ import annotations

import pytest
import requests

from support.servers import Server


def still_serves(server: Server) -> None:
    answer = requests.post(
        f"{server.url}/v1/completions",
        json={"model": server.served_model_name, "prompt": "Hello", "max_tokens": 4},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] > 0


def error_message(answer: requests.Response) -> str:
    body = answer.json()
    return str(body.get("message") or body.get("error", {}).get("message") or body)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_malformed_json(server: Server, path: str) -> None:
    answer = requests.post(
        f"{server.url}{path}",
        data=b'{"model": "x", "prompt": ',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert 400 <= answer.status_code < 500
    assert "JSON" in error_message(answer)
    still_serves(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model(server: Server, path: str) -> None:
    body = {
        "model": "no-such-model",
        "prompt": "Hello",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
    }
    answer = requests.post(f"{server.url}{path}", json=body, timeout=30)
    assert answer.status_code == 404
    message = error_message(answer)
    assert "no-such-model" in message and server.served_model_name in message
    still_serves(server)


def test_negative_max_tokens(server: Server) -> None:
    for path, body in [
        ("/v1/completions", {"model": server.served_model_name, "prompt": "Hi"}),
        (
            "/v1/chat/completions",
            {"model": server.served_model_name, "messages": [{"role": "user", "content": "Hi"}]},
        ),
    ]:
        answer = requests.post(f"{server.url}{path}", json={**body, "max_tokens": -5}, timeout=30)
        assert answer.status_code == 400, answer.text
        assert "max_tokens" in error_message(answer) and "-5" in error_message(answer)
    answer = requests.post(
        f"{server.url}/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": -5}},
        timeout=30,
    )
    assert answer.status_code == 400
    assert "max_new_tokens" in error_message(answer)
    still_serves(server)


def test_prompt_longer_than_context(server: Server) -> None:
    prompt = "many words in a row " * 2000  # well past the tiny model's 2048 tokens
    answer = requests.post(
        f"{server.url}/v1/completions",
        json={"model": server.served_model_name, "prompt": prompt, "max_tokens": 4},
        timeout=60,
    )
    assert answer.status_code == 400
    assert "context length" in error_message(answer)
    answer = requests.post(
        f"{server.url}/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 4}},
        timeout=60,
    )
    assert 400 <= answer.status_code < 500
    assert "context length" in error_message(answer)
    still_serves(server)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", "/generate", {"input_ids": [5, 99999999]}),
        ("POST", "/vertex_generate", {"instances": [{"input_ids": [5, 99999999]}]}),
        # A body of a shape the guard does not read: refused where SGLang tokenises.
        ("POST", "/v1/score", {"query": [5, 6], "items": [[5, 99999999]],
                               "label_token_ids": [1, 2]}),
    ],
)  # fmt: skip
def test_out_of_vocabulary_ids_on_any_route_are_refused(
    server: Server, method: str, path: str, body: dict
) -> None:
    """Each of these ended a single server for good (its scheduler died on an IndexError)."""
    answer = requests.request(method, f"{server.url}{path}", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert "99999999" in error_message(answer) and "vocabulary" in error_message(answer)
    still_serves(server)


def test_what_a_request_asks_for_is_bounded(server: Server) -> None:
    for body, field in [
        ({"text": "Hi", "top_logprobs_num": 2048, "return_logprob": True}, "top_logprobs_num"),
        ({"text": "Hi", "sampling_params": {"logit_bias": {"5": 1e308}}}, "logit_bias"),
        ({"text": ""}, "empty"),
    ]:
        answer = requests.post(f"{server.url}/generate", json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert field in error_message(answer)
    still_serves(server)


def test_no_other_origin_may_read_the_answers(server: Server) -> None:
    """Issue 31: a preflight from any origin got ``Access-Control-Allow-Origin`` echoed back
    (SGLang allows every origin, with credentials)."""
    evil = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    preflight = requests.options(f"{server.url}/generate", headers=evil, timeout=30)
    assert "access-control-allow-origin" not in {k.lower() for k in preflight.headers}
    answer = requests.get(f"{server.url}/v1/models", headers=evil, timeout=30)
    assert answer.status_code == 200
    assert "access-control-allow-origin" not in {k.lower() for k in answer.headers}
