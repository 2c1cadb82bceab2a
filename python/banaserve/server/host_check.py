"""An instance refuses requests whose ``Host`` header names another server (ASGI middleware;
the decision is :mod:`banaserve.api.host_names`)."""

from __future__ import annotations

from banaserve.api.host_names import check_host
from banaserve.api.request_limits import RequestRejected
from banaserve.server.request_guard import ASGIApp, Receive, Scope, Send, send_rejection


class HostCheck:
    """Passes every request whose ``Host`` is allowed to the app; answers 400 to the others.
    ``allowed`` None: every name (see :func:`~banaserve.api.host_names.allowed_host_names`)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.allowed is not None:
            host = next((v for k, v in scope["headers"] if k == b"host"), None)
            try:
                check_host(None if host is None else host.decode("latin-1"), self.allowed)
            except RequestRejected as exc:
                await send_rejection(send, exc)
                return
        await self.app(scope, receive, send)
