"""Checks on OpenAI requests that SGLang leaves out or words in its own terms.

SGLang ignores the ``model`` field of OpenAI requests, so a client with a typo in the model
name silently gets another model's answer: this ASGI middleware answers 404, as OpenAI does.
A negative ``max_tokens`` on a chat request reaches SGLang's sampler, whose error names its
internal ``max_new_tokens``: the middleware answers 400 naming the field the client sent.
It buffers the request body (OpenAI bodies are small) and replays it to SGLang unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPENAI_MODEL_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses"}
)
#: SGLang's documentation calls every server "default" in its OpenAI examples.
ALWAYS_ACCEPTED = frozenset({"default"})


TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


def json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object; None when it is not one (SGLang then rejects the body
    itself, with its own message)."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return payload if isinstance(payload, dict) else None


def negative_token_limit(payload: dict[str, Any]) -> tuple[str, str] | None:
    """The field and an error message for a negative token limit, or None."""
    for name in TOKEN_LIMIT_FIELDS:
        value = payload.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            return name, f"{name} must be a non-negative integer, got {value}."
    return None


class OpenAIRequestGuard:
    """ASGI middleware: 404 for an OpenAI request whose ``model`` is not served here, 400 for
    a negative token limit; everything else passes to SGLang untouched."""

    def __init__(self, app: ASGIApp, served_names: Iterable[str]) -> None:
        self.app = app
        self.served = frozenset(served_names) | ALWAYS_ACCEPTED

    def accepts(self, model: str) -> bool:
        # "name:adapter" selects a LoRA adapter of a served model; SGLang checks the adapter.
        return model in self.served or model.split(":", 1)[0] in self.served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in OPENAI_MODEL_PATHS
        ):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        payload = json_object(body)
        if payload is not None:
            model = payload.get("model")
            if isinstance(model, str) and not self.accepts(model):
                served = ", ".join(sorted(self.served - ALWAYS_ACCEPTED))
                error = f"The model '{model}' does not exist. This server serves: {served}."
                await send_error(send, 404, "NotFoundError", "model", error)
                return
            bad_limit = negative_token_limit(payload)
            if bad_limit is not None:
                await send_error(send, 400, "BadRequestError", *bad_limit)
                return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def send_error(send: Send, status: int, kind: str, param: str, message: str) -> None:
    """An error response in the shape SGLang's OpenAI server uses."""
    payload = {"object": "error", "message": message, "type": kind, "param": param, "code": status}
    data = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
