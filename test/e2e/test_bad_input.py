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
