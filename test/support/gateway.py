"""An in-process gateway on fake upstream instances (aiohttp), and requests to it."""

from __future__ import annotations

import resource
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from banaserve.cluster.client_guard import CappedSite, gateway_runner
from banaserve.cluster.gateway import Gateway
from banaserve.cluster.load_board import LoadBoard
from banaserve.cluster.topology import DECODE, PREFILL, InstanceSpec
from banaserve.router.placement import Placer
from banaserve.router.policies import make_policy
from banaserve.utils.processes import free_port

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: The admin token of the gateways made here; :func:`post` always carries it.
ADMIN_TOKEN = "unit-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@asynccontextmanager
async def upstream(handler: Handler, flush: Handler | None = None) -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_post("/generate", handler)
    if flush is not None:
        app.router.add_post("/flush_cache", flush)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


@asynccontextmanager
async def gateway_for(
    specs: list[InstanceSpec], board: LoadBoard | None = None, **options: Any
) -> AsyncIterator[str]:
    board = board if board is not None else LoadBoard(specs)
    gateway = Gateway(
        board, make_policy("round_robin", PREFILL), make_policy("round_robin", DECODE),
        placer=Placer(handoff_min_tokens=10),
        # Every long uncached prompt is handed off, even to an idle cluster.
        **{"admin_token": ADMIN_TOKEN, "spill_prefill": False, **options},
    )  # fmt: skip
    runner = gateway_runner(gateway.app(), gateway.client_limits)  # as cluster/run.py
    await runner.setup()
    port = free_port()
    cap = gateway.client_limits.connections(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    await CappedSite(runner, "127.0.0.1", port, cap).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def post(url: str, body: dict, headers: dict[str, str] = ADMIN) -> tuple[int, str]:
    """POST ``body``, as the admin unless ``headers`` say otherwise."""
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.post(url, json=body) as response,
    ):
        return response.status, await response.text()
