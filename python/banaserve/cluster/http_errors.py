"""Error responses in the shape SGLang's OpenAI server uses (its native API reads it too)."""

from __future__ import annotations

from aiohttp import web

#: Seconds a client is told to wait before trying a 503 again.
RETRY_AFTER_S = 5


def error_response(
    status: int, message: str, kind: str = "BadRequestError", headers: dict[str, str] | None = None
) -> web.Response:
    """An error in the shape SGLang's OpenAI server uses (its native API reads it too)."""
    return web.json_response(error_payload(status, message, kind), status=status, headers=headers)


def error_payload(status: int, message: str, kind: str) -> dict[str, object]:
    """The body of :func:`error_response`."""
    return {"object": "error", "message": message, "type": kind, "code": status}


def unavailable(message: str) -> web.Response:
    return error_response(
        503, message, "ServiceUnavailableError", {"Retry-After": str(RETRY_AFTER_S)}
    )
