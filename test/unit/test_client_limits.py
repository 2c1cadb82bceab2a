"""A slow, greedy or numerous client holds only its share of the gateway (issue 31, item 3):
real sockets to an in-process gateway on a fake instance. Before the fix a partial head or
body held its connection for an hour (aiohttp's keep-alive default), connections were
accepted until descriptors ran out, and bodies and answers were buffered without a bound."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from banaserve.cluster.topology import DECODE, InstanceSpec
from banaserve.config.client_limits import ClientLimits, connection_cap
from support.gateway import ADMIN, gateway_for, post, upstream

#: The timeouts the gateways here run with, and how long a test waits for their effect: a
#: bound far above them, so a slow machine cannot fail it and a missing timeout cannot pass.
TIMEOUT_S = 1.0
WAIT_S = 20.0


async def answer_ok(request: web.Request) -> web.Response:
    return web.json_response({"text": "ok"})


async def answer_big(request: web.Request) -> web.Response:
    return web.json_response({"text": "x" * 4000})


def specs_on(port: int) -> list[InstanceSpec]:
    return [InstanceSpec("decode-0", DECODE, port)]


async def raw_exchange(url: str, sent: bytes) -> bytes:
    """Send ``sent`` on a new connection, then read until the gateway closes it."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(sent)
    await writer.drain()
    try:
        async with asyncio.timeout(WAIT_S):
            return await reader.read()  # to EOF: the gateway closed the connection
    finally:
        writer.close()


HEAD = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def test_a_head_that_never_ends_loses_its_connection() -> None:
    async def scenario() -> None:
        async with (
            upstream(answer_ok) as port,
            gateway_for(
                specs_on(port), client_limits=ClientLimits(header_timeout_s=TIMEOUT_S)
            ) as url,
        ):
            assert await raw_exchange(url, HEAD) == b""  # closed, nothing answered
            status, _ = await post(f"{url}/generate", {"text": "hi"})
            assert status == 200

    asyncio.run(scenario())


def test_a_body_that_never_ends_is_answered_408() -> None:
    async def scenario() -> None:
        async with (
            upstream(answer_ok) as port,
            gateway_for(
                specs_on(port), client_limits=ClientLimits(body_timeout_s=TIMEOUT_S)
            ) as url,
        ):
            answer = await raw_exchange(url, HEAD + b'Content-Length: 100\r\n\r\n{"text":')
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b"--client-body-timeout" in answer

    asyncio.run(scenario())


def test_connections_over_the_cap_are_refused_and_served_once_one_closes() -> None:
    async def scenario() -> None:
        async with (
            upstream(answer_ok) as port,
            gateway_for(specs_on(port), client_limits=ClientLimits(max_connections=2)) as url,
        ):
            host, port_text = url.removeprefix("http://").split(":")
            held = []
            for _ in range(2):  # two clients keep their connections open, alive
                reader, writer = await asyncio.open_connection(host, int(port_text))
                writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert (await reader.readline()).startswith(b"HTTP/1.1 200")
                held.append(writer)
            answer = await raw_exchange(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 503"), answer
            assert b"--max-client-connections" in answer
            held.pop().close()
            for _ in range(100):  # until the gateway has seen the close
                status, _ = await post(f"{url}/generate", {"text": "hi"})
                if status == 200:
                    break
                await asyncio.sleep(0.1)
            assert status == 200
            for writer in held:
                writer.close()

    asyncio.run(scenario())


def test_bodies_and_answers_over_the_buffer_budget_get_503_and_give_it_back() -> None:
    async def scenario() -> None:
        limits = ClientLimits(buffer_budget_bytes=3000)
        async with (
            upstream(answer_ok) as port,
            gateway_for(specs_on(port), client_limits=limits) as url,
        ):
            status, text = await post(f"{url}/generate", {"text": "y" * 5000})
            assert status == 503 and "--gateway-buffer-bytes" in json.loads(text)["message"]
            for _ in range(3):  # what the refused request held was given back
                status, _ = await post(f"{url}/generate", {"text": "y" * 2000})
                assert status == 200
        async with (
            upstream(answer_big) as port,
            gateway_for(specs_on(port), client_limits=limits) as url,
        ):
            status, text = await post(f"{url}/generate", {"text": "hi"}, ADMIN)
            assert status == 503 and "--gateway-buffer-bytes" in text

    asyncio.run(scenario())


def test_the_connection_cap_leaves_descriptors_for_the_gateway_itself() -> None:
    assert connection_cap(1024) == (1024 - 256) // 2
    assert connection_cap(100) == 1
    assert ClientLimits(max_connections=7).connections(1024) == 7
    with pytest.raises(ValueError):
        ClientLimits(header_timeout_s=0)
