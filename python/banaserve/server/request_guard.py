"""Checks on requests that SGLang leaves out or words in its own terms, in front of its app.

An ASGI middleware on SGLang's HTTP server (one instance, and every instance of a cluster,
behind the gateway's own checks). A request with a body to any route that generates
(:data:`banaserve.api.sglang_routes.GENERATING`, every method but GET, HEAD and OPTIONS):

- must be ``application/json`` (415 otherwise; multipart for an audio upload), within
  ``--max-request-bytes`` (413) and ``--max-json-depth`` (400);
- if its body is a native, Vertex AI, OpenAI completions or chat body, must pass
  :func:`~banaserve.api.request_validation.validate_generation` (400): an out-of-vocabulary
  token id would otherwise kill the scheduler, and with it the server (the ids of every other
  route are checked where SGLang tokenises: :mod:`banaserve.server.token_id_check`);
- SGLang ignores the ``model`` field of OpenAI requests, so a client with a typo in the model
  name silently gets another model's answer: 404, as OpenAI answers.

It buffers the request body (at most the size limit) and replays it to SGLang unchanged. The
model's vocabulary and context come from SGLang's tokenizer manager once it is up.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from banaserve.api.request_limits import (
    ModelLimits,
    RequestLimits,
    RequestRejected,
    check_body_size,
    check_content_type,
    parse_json_object,
)
from banaserve.api.request_validation import CHAT, COMPLETIONS, GENERATE, validate_generation
from banaserve.api.sglang_routes import (
    BODILESS_METHODS,
    FORM,
    GENERATING,
    JSON_ONLY,
    VERTEX,
    vertex_as_native,
)

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


def sglang_model_limits() -> ModelLimits | None:
    """The served model's limits from SGLang's tokenizer manager (None before it is up)."""
    from sglang.srt.entrypoints.http_server import _global_state

    manager = getattr(_global_state, "tokenizer_manager", None) if _global_state else None
    if manager is None:
        return None
    tokenizer = getattr(manager, "tokenizer", None)
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    # See banaserve.cluster.intake.load_tokenizer: a bound on the bytes one token covers.
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1 << 19)
    return ModelLimits(manager.model_config.vocab_size, manager.context_len, 2 * longest)


class RequestGuard:
    """ASGI middleware: the checks above; everything else passes to SGLang untouched."""

    def __init__(
        self,
        app: ASGIApp,
        served_names: Iterable[str],
        limits: RequestLimits | None = None,
        model_limits: Callable[[], ModelLimits | None] = sglang_model_limits,
    ) -> None:
        self.app = app
        self.served = frozenset(served_names) | ALWAYS_ACCEPTED
        self.limits = limits or RequestLimits()
        self._model_limits = model_limits
        self._model: ModelLimits | None = None

    def accepts(self, model: str) -> bool:
        # "name:adapter" selects a LoRA adapter of a served model; SGLang checks the adapter.
        return model in self.served or model.split(":", 1)[0] in self.served

    @property
    def model(self) -> ModelLimits | None:
        if self._model is None:
            self._model = self._model_limits()
        return self._model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = GENERATING.get(scope["path"]) if scope["type"] == "http" else None
        if kind is None or scope["method"] in BODILESS_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            messages = await self._read(scope, receive, kind)
            body = b"".join(m.get("body", b"") for m in messages)
            if kind != FORM:
                self._check(scope["path"], kind, body)
        except RequestRejected as exc:
            await send_rejection(send, exc)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive, kind: str) -> list[Message]:
        """The body's messages, refused as soon as the headers or the bytes break a limit."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if kind != FORM:
            check_content_type(headers.get("content-type"))
        if headers.get("content-length", "").isdigit():
            check_body_size(int(headers["content-length"]), self.limits)
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            check_body_size(size, self.limits)
            if not message.get("more_body", False):
                break
        return messages

    def _check(self, path: str, kind: str, raw: bytes) -> None:
        payload = parse_json_object(raw, self.limits)
        model = payload.get("model")
        if path in OPENAI_MODEL_PATHS and isinstance(model, str) and not self.accepts(model):
            served = ", ".join(sorted(self.served - ALWAYS_ACCEPTED))
            raise RequestRejected(
                404, f"The model '{model}' does not exist. This server serves: {served}.", "model"
            )
        if kind == JSON_ONLY or self.model is None:
            return
        if kind == VERTEX:
            validate_generation(GENERATE, vertex_as_native(payload), self.model, self.limits)
        elif kind in (GENERATE, COMPLETIONS, CHAT):
            validate_generation(kind, payload, self.model, self.limits)


async def send_rejection(send: Send, rejection: RequestRejected) -> None:
    data = json.dumps(rejection.payload()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": rejection.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
