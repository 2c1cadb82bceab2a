"""Error responses in the shape SGLang's OpenAI server uses (its native API reads it too)."""

from __future__ import annotations

from aiohttp import web

#: Seconds a client is told to wait before trying a 503 again.
RETRY_AFTER_S = 5


def error_response(
    status: int, message: str, kind: str = "BadRequestError", headers: dict[str, str] | None = None
) -> web.Response:
    """An error in the shape SGLang's OpenAI server uses (its native API reads it too)."""
    payload = {"object": "error", "message": message, "type": kind, "code": status}
    return web.json_response(payload, status=status, headers=headers)


def unavailable(message: str) -> web.Response:
    return error_response(
        503, message, "ServiceUnavailableError", {"Retry-After": str(RETRY_AFTER_S)}
    )
