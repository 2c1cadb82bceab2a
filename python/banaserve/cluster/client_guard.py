"""The gateway's side of :mod:`banaserve.config.client_limits`: the site that caps client
connections and times out slow heads, and the budget for the bytes it holds for clients.

A request's head is timed by aiohttp's keep-alive timer (it closes a connection whose handler
still waits for a whole request head when the timer fires, however much of one came in);
its body by :func:`read_body`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterable, Callable, Iterator

from aiohttp import web

from banaserve.api.request_limits import (
    RequestLimits,
    RequestRejected,
    check_body_size,
    check_content_type,
)
from banaserve.cluster.http_errors import RETRY_AFTER_S, error_payload, unavailable
from banaserve.config.client_limits import ClientLimits

logger = logging.getLogger(__name__)


class BufferFull(Exception):
    """Holding more bytes would take the gateway over its budget."""


class ByteBudget:
    """Bytes of request bodies and answers held for clients, at most ``total``.

    Used from the gateway's event loop only (no lock). Taking never waits: over the budget
    it raises :class:`BufferFull`, and the request is answered 503."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.held = 0

    @contextlib.contextmanager
    def holding(self) -> Iterator[Holding]:
        """What one request holds; given back when the block ends."""
        held = Holding(self)
        try:
            yield held
        finally:
            self.held -= held.bytes

    def middleware(self) -> web.Middleware:
        """Gives each request a :class:`Holding`, under :data:`HOLDING`."""

        @web.middleware
        async def hold(request: web.Request, handler: web.Handler) -> web.StreamResponse:
            with self.holding() as held:
                request[HOLDING] = held
                try:
                    return await handler(request)
                except BufferFull as exc:
                    return unavailable(f"The gateway is busy: {exc}.")

        return hold


class Holding:
    """The bytes one request holds of a :class:`ByteBudget`."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def check(self, size: int) -> None:
        """Raise :class:`BufferFull` now if ``size`` more bytes would not fit."""
        if self.budget.held + size > self.budget.total:
            raise BufferFull(
                f"the gateway holds {self.budget.held} bytes of requests and answers and "
                f"{size} more would exceed its budget of {self.budget.total} "
                "(--gateway-buffer-bytes)"
            )

    def take(self, size: int) -> None:
        self.check(size)
        self.budget.held += size
        self.bytes += size


async def read_within(
    chunks: AsyncIterable[bytes], held: Holding, check_size: Callable[[int], None] | None = None
) -> bytes:
    """Every chunk of ``chunks``, each taken from ``held`` before it is kept;
    ``check_size`` sees the size read so far after each chunk and may raise."""
    parts = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if check_size is not None:
            check_size(size)
        held.take(len(chunk))
        parts.append(chunk)
    return b"".join(parts)


async def read_body(request: web.Request, limits: RequestLimits, timeout_s: float) -> bytes:
    """A generation request's body: refused from its headers before any of it is read
    (415 not JSON, 413 too large, 503 over the buffer budget), and while it is read when it
    grows too large (413), does not fit the budget (503) or takes over ``timeout_s`` (408)."""
    check_content_type(request.headers.get("Content-Type"))
    held = request[HOLDING]
    if request.content_length is not None:
        check_body_size(request.content_length, limits)
        held.check(request.content_length)
    try:
        async with asyncio.timeout(timeout_s):
            return await read_within(
                request.content.iter_any(), held, lambda size: check_body_size(size, limits)
            )
    except TimeoutError:
        raise RequestRejected(
            408, f"The request body did not arrive within {timeout_s:g} s (--client-body-timeout)."
        ) from None


#: Where a request's :class:`Holding` is kept (aiohttp requests are mappings).
HOLDING = web.RequestKey("banaserve.holding", Holding)


class _Refuse(asyncio.Protocol):
    """Answers a connection over the cap with a 503 and closes it."""

    def __init__(self, cap: int) -> None:
        message = f"The gateway has {cap} client connections open, its limit " \
                  "(--max-client-connections); retry shortly."  # fmt: skip
        body = json.dumps(error_payload(503, message, "ServiceUnavailableError")).encode()
        self.answer = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: %d\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (RETRY_AFTER_S, len(body), body)
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.answer)
        transport.close()


class CappedSite(web.TCPSite):
    """A TCP site whose server accepts at most ``cap`` client connections at once; the
    others get a 503 and are closed at once (the listening socket keeps accepting, so no
    client waits in the backlog for a slot)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, cap: int) -> None:
        super().__init__(runner, host, port)
        self.cap = cap
        self.refused = 0

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        if len(server.connections) >= self.cap:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                logger.warning("%d client connections refused so far: %d open, the limit",
                               self.refused, self.cap)  # fmt: skip
            return _Refuse(self.cap)
        return server()

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol, self._host, self._port, backlog=self._backlog
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]


def gateway_runner(app: web.Application, limits: ClientLimits) -> web.AppRunner:
    """The runner of the gateway's app: a client that leaves cancels its handler (its
    upstream connection closes, and SGLang aborts the request), and aiohttp's keep-alive
    timer is the head timeout."""
    return web.AppRunner(app, access_log=None, handler_cancellation=True,
                         keepalive_timeout=limits.header_timeout_s)  # fmt: skip
