"""The instance guard checks every route that generates, whatever its method (issue 31:
``PUT /generate`` and ``/vertex_generate`` reached SGLang unchecked, and one
out-of-vocabulary id ended a single server). That every route of SGLang's app is in a table
is ``e2e/test_sglang_route_table.py``'s (importing SGLang's server starts a process)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from banaserve.api.request_limits import ModelLimits
from banaserve.server import token_id_check
from banaserve.server.request_guard import RequestGuard

MODEL = ModelLimits(vocab_size=2048, context_length=512, max_token_bytes=8)


class App:
    """The app behind the guard: records what reached it."""

    def __init__(self) -> None:
        self.reached: list[tuple[str, str, bytes]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.reached.append((scope["method"], scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(guard: RequestGuard, method: str, path: str, body: bytes,
         content_type: str = "application/json") -> tuple[int, dict]:  # fmt: skip
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(b"content-type", content_type.encode())]}  # fmt: skip
    asyncio.run(guard(scope, receive, send))
    answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(answer or b"{}")


def guarded() -> tuple[RequestGuard, App]:
    app = App()
    return RequestGuard(app, ["tiny"], model_limits=lambda: MODEL), app


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", "/generate", {"input_ids": [5, 99999999]}),
        ("POST", "/encode", {"input_ids": [5, 99999999]}),
        ("PUT", "/classify", {"input_ids": [[1], [-3]]}),
        ("POST", "/vertex_generate", {"instances": [{"input_ids": [5, 99999999]}]}),
        ("POST", "/vertex_generate", {"instances": [{"text": "x"}],
                                      "parameters": {"top_logprobs_num": 2048}}),
        ("POST", "/invocations", {"messages": [{"role": "user", "content": "x"}],
                                  "logit_bias": {"5": 1e308}}),
    ],
)  # fmt: skip
def test_every_method_of_a_generating_route_is_checked(method: str, path: str, body: dict) -> None:
    guard, app = guarded()
    status, answer = call(guard, method, path, json.dumps(body).encode())
    assert status == 400, answer
    assert app.reached == []  # SGLang never saw it


def test_routes_of_other_shapes_get_the_json_bounds() -> None:
    guard, app = guarded()
    assert call(guard, "POST", "/v1/score", b"{}", "text/plain")[0] == 415
    assert call(guard, "POST", "/v1/messages", b'{"a": ', "application/json")[0] == 400
    assert call(guard, "POST", "/api/generate", b"[" * 100 + b"]" * 100)[0] == 400
    assert app.reached == []
    # Bodiless reads, multipart uploads and routes that do not generate pass untouched.
    for method, path, content_type in [
        ("GET", "/generate", "application/json"),
        ("POST", "/v1/audio/transcriptions", "multipart/form-data; boundary=x"),
        ("POST", "/flush_cache", "text/plain"),
    ]:
        assert call(guard, method, path, b"", content_type)[0] == 200
    fine = {"instances": [{"text": "x"}], "parameters": {"sampling_params": {"max_new_tokens": 2}}}
    assert call(guard, "POST", "/vertex_generate", json.dumps(fine).encode())[0] == 200
    assert [(m, p) for m, p, _ in app.reached] == [
        ("GET", "/generate"), ("POST", "/v1/audio/transcriptions"), ("POST", "/flush_cache"),
        ("POST", "/vertex_generate"),
    ]  # fmt: skip
    assert app.reached[-1][2] == json.dumps(fine).encode()  # replayed unchanged


def test_token_ids_are_checked_where_sglang_tokenises() -> None:
    calls = []

    def validate(self: Any, obj: Any, input_ids: list[int] | None) -> None:
        calls.append(input_ids)

    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))
    checked = token_id_check.checking_ids(validate)
    checked(manager, None, [0, 99])
    checked(manager, None, None)  # input_embeds: nothing to check
    with pytest.raises(ValueError, match=r"token id 100, outside the vocabulary \[0, 100\)"):
        checked(manager, None, [5, 100])
    assert calls == [[0, 99], None, [5, 100]]  # SGLang's own checks ran first
