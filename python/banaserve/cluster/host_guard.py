"""The gateway refuses requests whose ``Host`` header names another server (aiohttp
middleware; the decision is :mod:`banaserve.api.host_names`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from banaserve.api.host_names import check_host
from banaserve.api.request_limits import RequestRejected
from banaserve.cluster.http_errors import error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def host_guard(
    allowed: frozenset[str] | None,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """A middleware answering 400 to a request for a host name not in ``allowed`` (None:
    every name)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            check_host(request.headers.get("Host"), allowed)
        except RequestRejected as exc:
            return error_response(exc.status, exc.message, exc.kind)
        return await handler(request)

    return guard
