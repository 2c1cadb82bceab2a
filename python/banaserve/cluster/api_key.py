"""``--api-key`` on a cluster: the gateway asks clients for the key as SGLang's server does, and
sends it on every call it makes to an instance (each instance is started with the same key).

SGLang 0.5.23 (``sglang/srt/utils``' ``add_api_key_middleware``) answers 401
``{"error": "Unauthorized"}`` unless ``Authorization`` is ``Bearer <key>``, except for OPTIONS
requests and paths under ``/health`` and ``/metrics``; the gateway does the same, so a client
sees one behaviour whether it talks to one server or to a cluster. Without the key on its own
calls the gateway's relays, prefill steps and ``/v1/loads`` polls would all be refused (they
were, before this module).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

#: Paths served without the key (SGLang's exemptions): probes and scrapers carry none.
OPEN_PREFIXES = ("/health", "/metrics")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def bearer(api_key: str | None) -> dict[str, str]:
    """The header that carries ``api_key`` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def require_api_key(
    api_key: str,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """An aiohttp middleware refusing requests without ``api_key``, as SGLang does."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" or request.path.startswith(OPEN_PREFIXES):
            return await handler(request)
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check
