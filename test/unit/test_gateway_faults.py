"""The gateway's intake and poison-pill handling against small real upstreams (no SGLang).

Upstreams are aiohttp servers on real sockets; the supervisor is a stand-in that reports the
deaths a test scripts (the real one is exercised by test_cluster_supervision.py).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from banaserve.api.request_limits import ModelLimits, RequestLimits
from banaserve.cluster.intake import Intake
from banaserve.cluster.load_board import LoadBoard
from banaserve.cluster.supervisor import Death
from banaserve.cluster.topology import DECODE, PREFILL, InstanceSpec
from support.gateway import ADMIN, ADMIN_TOKEN, gateway_for, post, upstream

MODEL = ModelLimits(vocab_size=100, context_length=64, max_token_bytes=4)


async def raw_post(url: str, data: bytes, content_type: str) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers={"Content-Type": content_type}) as response,
    ):
        return response.status, await response.json()


def test_bad_bodies_never_reach_an_instance() -> None:
    seen: list[bytes] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"text": "ok"})

    async def scenario() -> None:
        async with upstream(record) as port:
            intake = Intake(RequestLimits(max_body_bytes=4096, max_json_depth=8, max_n=4), MODEL)
            async with gateway_for([InstanceSpec("decode-0", DECODE, port)], intake=intake) as url:
                cases = [
                    (b'{"text": "hi"}', "text/plain", 415, "application/json"),
                    (b'{"text": "' + b"x" * 5000 + b'"}', "application/json", 413,
                     "--max-request-bytes"),
                    (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", "application/json", 400,
                     "deeper than 8"),
                    (b'{"input_ids": [5, 99999999]}', "application/json", 400, "vocabulary"),
                    (b'{"text": "hi", "sampling_params": {"n": 2000}}', "application/json",
                     400, "--max-request-n"),
                    (json.dumps({"text": "y" * 300}).encode(), "application/json", 400,
                     "context length"),
                ]  # fmt: skip
                for data, content_type, status, words in cases:
                    got, body = await raw_post(f"{url}/generate", data, content_type)
                    assert (got, words in body["message"]) == (status, True), (got, body)
                assert seen == []
                status, _ = await post(f"{url}/generate", {"text": "fine"})
                assert status == 200 and len(seen) == 1

    asyncio.run(scenario())


@dataclass
class ScriptedDeaths:
    """Stands in for the supervisor: each request that reaches ``crashing`` kills it (the
    upstream aborts the connection), and the instance is 'restarted' at once."""

    crashing: set[int]
    by_itself: bool
    board: LoadBoard
    runs: dict[str, int] = field(default_factory=dict)
    waited_back: list[str] = field(default_factory=list)

    def pid_of(self, url: str) -> int:
        return self.runs.setdefault(url, 1)

    async def death_of(self, url: str, pid: int, wait_s: float) -> Death | None:
        if int(url.rsplit(":", 1)[1]) not in self.crashing:
            return None
        self.runs[url] = pid + 1
        return Death(url, pid, -9, 0.0, self.by_itself)

    async def wait_back(self, url: str, timeout_s: float) -> bool:
        self.waited_back.append(url)
        self.board.revive(url)
        return True

    def report(self) -> dict[str, dict]:
        return {}


def crash_on_pill(hits: list[int], port_of: dict[str, int], name: str):  # noqa: ANN201
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        hits.append(port_of[name])
        if body.get("text") == "pill":
            assert request.transport is not None
            request.transport.abort()  # the instance dies serving it
            return web.Response()
        return web.json_response({"text": "ok"})

    return handler


def test_a_poison_pill_costs_one_instance_and_is_quarantined() -> None:
    hits: list[int] = []
    ports: dict[str, int] = {}

    async def scenario() -> None:
        async with (
            upstream(crash_on_pill(hits, ports, "a")) as ports["a"],
            upstream(crash_on_pill(hits, ports, "b")) as ports["b"],
        ):
            specs = [InstanceSpec("decode-0", DECODE, ports["a"]),
                     InstanceSpec("decode-1", DECODE, ports["b"])]  # fmt: skip
            board = LoadBoard(specs)
            deaths = ScriptedDeaths({ports["a"], ports["b"]}, True, board)
            async with gateway_for(specs, board, deaths=deaths) as url:
                status, text = await post(f"{url}/generate", {"text": "pill"})
                assert status == 500 and "second time" in text and "digest" in text
                # Retried once, on the instance it crashed (once restarted), never the other.
                assert len(hits) == 2 and hits[0] == hits[1] and len(deaths.waited_back) == 1
                status, text = await post(f"{url}/generate", {"text": "pill"})
                assert status == 400 and "refused for another" in text
                # Known by what it asks, not its bytes: spacing and escapes change nothing.
                async with aiohttp.ClientSession() as session, session.post(
                    f"{url}/generate", data=b'{ "text" :\t"pil\\u006c" }',
                    headers={"Content-Type": "application/json"},
                ) as answer:  # fmt: skip
                    assert answer.status == 400 and "refused for another" in await answer.text()
                assert len(hits) == 2  # the quarantined body reached nobody
                status, _ = await post(f"{url}/generate", {"text": "fine"})
                assert status == 200

    asyncio.run(scenario())


def test_a_request_on_a_killed_instance_is_retried_elsewhere_once() -> None:
    hits: list[int] = []
    ports: dict[str, int] = {}

    async def scenario() -> None:
        async with (
            upstream(crash_on_pill(hits, ports, "p")) as ports["p"],
            upstream(crash_on_pill(hits, ports, "d")) as ports["d"],
        ):
            # Both "die" serving it, but by a kill from outside (OOM): elsewhere, then 500.
            specs = [InstanceSpec("prefill-0", PREFILL, ports["p"]),
                     InstanceSpec("decode-0", DECODE, ports["d"])]  # fmt: skip
            board = LoadBoard(specs)
            deaths = ScriptedDeaths({ports["p"], ports["d"]}, False, board)
            async with gateway_for(specs, board, deaths=deaths) as url:
                status, text = await post(f"{url}/generate", {"text": "pill"})
                assert status == 500 and "second time" in text
                assert sorted(hits) == sorted([ports["p"], ports["d"]]) and not deaths.waited_back

    asyncio.run(scenario())


def test_with_an_api_key_the_gateway_asks_for_it_and_sends_it_on() -> None:
    """``--api-key``: clients need it, as on one SGLang server; relays carry it to the
    instances (which are started with it; the polls too: ``e2e/test_cluster_clients.py``)."""
    seen: list[str | None] = []

    async def generate(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"text": "ok"})

    async def scenario() -> None:
        async with upstream(generate) as port:
            specs = [InstanceSpec("decode-0", DECODE, port)]
            async with gateway_for(specs, api_key="k1") as url, aiohttp.ClientSession() as client:
                for headers in ({}, {"Authorization": "Bearer k2"}, {"Authorization": "k1"}):
                    async with client.post(f"{url}/generate", json={"text": "x"},
                                           headers=headers) as answer:  # fmt: skip
                        assert answer.status == 401 and await answer.json() == {
                            "error": "Unauthorized"
                        }
                async with client.get(f"{url}/health") as answer:
                    assert answer.status == 200
                key = {"Authorization": "Bearer k1"}
                async with client.post(f"{url}/generate", json={"text": "x"}, headers=key) as ok:
                    assert ok.status == 200
        assert seen == ["Bearer k1"]  # the refused requests reached no instance

    asyncio.run(scenario())


def test_admin_calls_need_the_admin_token() -> None:
    """Issue 31: ``/clear_caches``, ``/flush_cache`` and ``POST /migration`` ran for anyone who
    reached the port, and ``/cluster`` showed anyone the processes' ids and arguments."""
    flushed: list[str | None] = []

    async def flush(request: web.Request) -> web.Response:
        flushed.append(request.headers.get("Authorization"))
        return web.Response(text="ok")

    async def generate(_: web.Request) -> web.Response:
        return web.json_response({"text": "ok"})

    async def scenario() -> None:
        async with upstream(generate, flush) as port:
            specs = [InstanceSpec("decode-0", DECODE, port)]
            async with gateway_for(specs, api_key="k1") as url:
                for headers in ({}, {"Authorization": "Bearer k1"}, {"Authorization": "Bearer x"}):
                    for path in ("/clear_caches", "/flush_cache", "/migration"):
                        status, text = await post(f"{url}{path}", {}, headers)
                        assert status == 401 and "admin token" in text, (path, headers)
                assert flushed == []  # nothing reached an instance
                status, _ = await post(f"{url}/flush_cache", {})  # as the admin
                assert status == 200 and flushed == [f"Bearer {ADMIN_TOKEN}"]
                async with aiohttp.ClientSession() as client:
                    key = {"Authorization": "Bearer k1"}
                    async with client.get(f"{url}/cluster", headers=key) as answer:
                        shown = await answer.json()
                    async with client.get(f"{url}/cluster", headers=ADMIN) as answer:
                        whole = await answer.json()
                assert "args" not in shown["instances"][0] and "args" in whole["instances"][0]

    asyncio.run(scenario())


def test_server_info_through_the_gateway_never_shows_the_keys() -> None:
    """SGLang's ``/server_info`` lists every server argument, ``api_key`` and
    ``admin_api_key`` (the cluster's admin token) included, and the command line."""
    from banaserve.cluster.credentials import redacted_server_info

    info = {"model_path": "/m", "api_key": "k1", "admin_api_key": "a1", "port": 1,
            "launch_command": "python -m x --api-key k1 --admin-api-key=a1 --port 1"}  # fmt: skip
    shown = redacted_server_info(info, admin=False)
    assert shown == {"model_path": "/m", "api_key": "<redacted>", "admin_api_key": "<redacted>",
                     "port": 1}  # fmt: skip
    command = redacted_server_info(info, admin=True)["launch_command"]
    assert command == "python -m x --api-key <redacted> --admin-api-key=<redacted> --port 1"
    assert redacted_server_info({"api_key": None}, admin=False) == {"api_key": None}
    # Known secrets are scrubbed wherever they show, at any depth.
    nested = {"internal_states": [{"api_key": "k1", "argv": ["--x", "k1"], "note": "a1 b"}]}
    assert redacted_server_info(nested, False, ("k1", "a1", None)) == {
        "internal_states": [{"api_key": "<redacted>", "argv": ["--x", "<redacted>"],
                             "note": "<redacted> b"}]
    }  # fmt: skip
