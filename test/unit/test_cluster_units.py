"""The cluster's pieces without SGLang: topology, argv rewriting, request shaping, metrics,
and the gateway's fault handling against small real HTTP upstreams on real sockets.

The cluster's command line as a process is ``e2e/test_cluster_cli.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from banaserve.api.request_validation import CHAT, COMPLETIONS, GENERATE
from banaserve.cluster.gateway import Gateway
from banaserve.cluster.load_board import LoadBoard
from banaserve.cluster.prometheus import render_metrics
from banaserve.cluster.relay_bodies import prefill_body
from banaserve.cluster.run import instance_launch_argv, memory_plan
from banaserve.cluster.topology import DECODE, PREFILL, InstanceSpec, plan_cores, plan_instances
from banaserve.config.cli import (
    KV_STORE_VALUE_FLAGS,
    build_parser,
    drop_flags,
)
from banaserve.config.store_options import KvStoreOptions
from banaserve.kvstore.client import KvStoreError
from banaserve.launch_server import plan_launch
from banaserve.router.placement import NoStorePlacer
from banaserve.router.policies import POLICY_NAMES, make_policy
from banaserve.router.request_shape import shape_request
from banaserve.utils.processes import free_port
from support.gateway import ADMIN, Handler, gateway_for, post, upstream


def test_cores_are_shared_out_evenly() -> None:
    assert plan_cores(2, [0, 1]) == [(0,), (1,)]
    assert plan_cores(2, [0, 1, 2, 3]) == [(0, 1), (2, 3)]
    assert plan_cores(3, [4, 5]) == [(4,), (5,), (4,)]  # more instances than cores
    with pytest.raises(ValueError):
        plan_cores(1, [])


def test_instances_are_named_by_role() -> None:
    specs = plan_instances(2, 1, [1001, 1002, 1003], [(0,), (1,), (0,)])
    assert [(s.name, s.role, s.port, s.cores) for s in specs] == [
        ("prefill-0", PREFILL, 1001, (0,)),
        ("prefill-1", PREFILL, 1002, (1,)),
        ("decode-0", DECODE, 1003, (0,)),
    ]
    with pytest.raises(ValueError):
        plan_instances(1, 1, [1001], None)


def test_instance_argv_drops_cluster_gateway_and_store_flags() -> None:
    argv = ["--model-path", "/m", "--num-prefill=2", "--num-decode", "1", "--port", "9",
            "--host=0.0.0.0", "--cpu-affinity", "--kv-store", "embedded", "--dtype", "float32",
            "--router-policy", "round_robin"]  # fmt: skip
    store = KvStoreOptions(["shm://h:1"], False, None, 1, 2.0, "t", "hicache", 5.0)
    out = instance_launch_argv(argv, store, ["shm://h:1"], "/m", 3, 0.3)
    assert out[:4] == ["--model-path", "/m", "--dtype", "float32"]
    rest = dict(zip(out[4::2], out[5::2], strict=True))
    assert rest["--kv-store"] == "shm://h:1" and rest["--kv-store-tenant"] == "t"
    assert rest["--kv-store-coalesce-wait-s"] == "5.0"
    assert float(rest["--kv-pool-memory-fraction"]) == pytest.approx(0.1)
    for gone in ("--num-prefill", "--num-decode", "--port", "--host", "--cpu-affinity",
                 "--router-policy", "embedded", "9", "0.0.0.0"):  # fmt: skip
        assert not any(a == gone or a.startswith(gone + "=") for a in out), (gone, out)
    assert drop_flags(["--a", "1", "--b"], ("--a",), ("--b",)) == []


def test_store_options_reach_an_instance_unchanged() -> None:
    store = KvStoreOptions(["shm://h:1"], True, None, 2, 2.0, "tenant a", "linker", 7.5)
    urls = ["shm://h:1", "shm://h:2"]
    args = build_parser().parse_args(["--model-path", "/m", *store.instance_flags(urls)])
    assert KvStoreOptions.from_args(args) == dataclasses.replace(store, urls=urls, embedded=False)


def test_every_store_flag_is_one_the_cluster_hands_its_instances() -> None:
    flags = {option for action in build_parser()._actions for option in action.option_strings
             if option.startswith("--kv-store")}  # fmt: skip
    assert flags == set(KV_STORE_VALUE_FLAGS)


def test_every_router_policy_name_makes_that_policy() -> None:
    for name in POLICY_NAMES:
        assert make_policy(name, DECODE).name == name


def test_request_shape_and_prefill_body() -> None:
    body = {"text": "a b c", "sampling_params": {"max_new_tokens": 9, "temperature": 0},
            "stream": True, "return_logprob": True}  # fmt: skip
    shape = shape_request(GENERATE, body, lambda text: len(text.split()))
    assert (shape.prompt, shape.prompt_tokens, shape.stream, shape.max_new_tokens) == (
        "a b c", 3, True, 9,
    )  # fmt: skip
    sent = prefill_body(GENERATE, body)
    assert sent["stream"] is False and sent["sampling_params"]["max_new_tokens"] == 1
    assert "return_logprob" not in sent and body["sampling_params"]["max_new_tokens"] == 9
    assert shape_request(GENERATE, {"input_ids": [1, 2, 3, 4]}).prompt_tokens == 4

    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}],
            "max_tokens": 7, "stream": True, "n": 2, "logprobs": True}  # fmt: skip
    shape = shape_request(CHAT, chat)
    assert shape.prompt_tokens == 100 and shape.max_new_tokens == 7  # 4 characters a token
    sent = prefill_body(CHAT, chat)
    assert (sent["max_tokens"], sent["n"], sent["stream"]) == (1, 1, False)
    assert "logprobs" not in sent
    # Token ids are matched as text, so requests sharing an id prefix share a text prefix.
    ids = shape_request(GENERATE, {"input_ids": [11, 12, 13]}).prompt
    assert ids.startswith("[11, 12") and shape_request(COMPLETIONS, {"prompt": [11, 12]}).prompt


def test_metrics_render_every_instance() -> None:
    board = LoadBoard([InstanceSpec("prefill-0", PREFILL, 1), InstanceSpec("decode-0", DECODE, 2)])
    gateway = Gateway(board, make_policy("load_aware", PREFILL), make_policy("load_aware", DECODE))
    text = render_metrics(gateway.cluster_state())
    assert 'banaserve_instance_healthy{instance="prefill-0",role="prefill"} 1' in text
    assert 'banaserve_instance_routed_total{instance="decode-0",role="decode"} 0' in text
    assert "banaserve_gateway_requests_total 0" in text


# -- the gateway against small upstreams on real sockets --------------------------------------


async def answer_ok(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"text": "ok", "max": body["sampling_params"]["max_new_tokens"]})


#: A prompt long enough to hand off, and an output long enough that it is (short ones run
#: whole: ``in_place_max_new_tokens``).
LONG = {"text": "word " * 100, "sampling_params": {"max_new_tokens": 32}}


def test_unreachable_instances_are_retried_elsewhere() -> None:
    async def scenario() -> None:
        async with upstream(answer_ok) as good:
            dead = free_port()  # nothing listens there
            specs = [InstanceSpec("prefill-0", PREFILL, dead), InstanceSpec("prefill-1", PREFILL,
                     good), InstanceSpec("decode-0", DECODE, dead),
                     InstanceSpec("decode-1", DECODE, good)]  # fmt: skip
            async with gateway_for(specs) as url:
                for _ in range(3):
                    status, text = await post(f"{url}/generate", LONG)
                    assert status == 200 and json.loads(text) == {"text": "ok", "max": 32}

    asyncio.run(scenario())


def test_prefill_refusal_reaches_the_client_and_no_instance_is_a_503() -> None:
    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"message": "prompt too long"}, status=400)

    async def scenario() -> None:
        async with upstream(refuse) as port:
            specs = [InstanceSpec("prefill-0", PREFILL, port),
                     InstanceSpec("decode-0", DECODE, free_port())]  # fmt: skip
            async with gateway_for(specs) as url:
                status, text = await post(f"{url}/generate", LONG)
                assert status == 400 and "prompt too long" in text
                # Short prompts skip the prefill; the decode is unreachable and the prefill
                # instance refuses everything: a clear 400 from it, never a hang.
                status, text = await post(f"{url}/generate", {"text": "hi"})
                assert status == 400
            specs = [InstanceSpec("decode-0", DECODE, free_port())]
            async with gateway_for(specs) as url:
                status, text = await post(f"{url}/generate", {"text": "hi"})
                assert status == 503 and "No instance could serve" in text
                status, _ = await post(f"{url}/generate", {"text": "hi"})
                assert status == 503

    asyncio.run(scenario())


def test_a_prompt_the_cluster_holds_skips_the_prefill_step() -> None:
    seen: list[tuple[int, int]] = []  # (port, max_new_tokens) per request an instance got

    def recording(port_of: Callable[[], int]) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            body = await request.json()
            seen.append((port_of(), body["sampling_params"]["max_new_tokens"]))
            return web.json_response({"text": "ok"})

        return handler

    async def scenario() -> None:
        ports: dict[str, int] = {}
        async with (
            upstream(recording(lambda: ports["p"])) as ports["p"],
            upstream(recording(lambda: ports["d"])) as ports["d"],
        ):
            specs = [InstanceSpec("prefill-0", PREFILL, ports["p"]),
                     InstanceSpec("decode-0", DECODE, ports["d"])]  # fmt: skip
            async with gateway_for(specs) as url:
                assert (await post(f"{url}/generate", LONG))[0] == 200
                assert seen == [(ports["p"], 1), (ports["d"], 32)]  # the handoff
                seen.clear()
                question = {"text": LONG["text"] + "why?", "sampling_params": {
                    "max_new_tokens": 5}}  # fmt: skip
                for _ in range(4):
                    assert (await post(f"{url}/generate", question))[0] == 200
                # Prefix known: one request each, no prefill step, over both instances.
                assert sorted(seen) == sorted([(ports["p"], 5), (ports["d"], 5)] * 2)
                seen.clear()
                long_output = {"text": LONG["text"], "sampling_params": {"max_new_tokens": 99}}
                for _ in range(2):
                    assert (await post(f"{url}/generate", long_output))[0] == 200
                assert seen == [(ports["d"], 99)] * 2  # decoding stays on decode instances

    asyncio.run(scenario())


@pytest.mark.parametrize("leader_tokens", [32, 5])
def test_a_burst_on_a_new_prefix_waits_for_the_prompt_computed(leader_tokens: int) -> None:
    """A long first request is handed off and the burst waits for its prefill step; a short
    one runs whole and the burst waits until it answers."""
    # Until issue 35 the prefill step lasted 0.5 s and the burst came 0.1 s after it began, so
    # a slow machine could send the burst after the step ended and pass without testing the
    # wait. Now the step lasts until the gateway counts all three followers waiting for it.
    events: list[str] = []
    release = asyncio.Event()

    async def held_first(request: web.Request) -> web.Response:
        body = await request.json()
        if not events:
            events.append(f"computing {body['sampling_params']['max_new_tokens']}")
            await release.wait()
            events.append("computed")
        else:
            events.append("served")
        return web.json_response({"text": "ok"})

    async def followed(url: str) -> int:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/cluster") as answer:
            return (await answer.json())["gateway"]["followed"]

    async def until(predicate: Callable[[], Awaitable[bool]]) -> None:
        for _ in range(3000):  # 30 s: only a bound for a broken run
            if await predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("state not reached")

    async def scenario() -> None:
        async with upstream(held_first) as port:
            specs = [InstanceSpec("prefill-0", PREFILL, port)]
            async with gateway_for(specs) as url:
                follower = {"text": LONG["text"] + "why?", "sampling_params": {
                    "max_new_tokens": 5}}  # fmt: skip
                leader = {"text": LONG["text"], "sampling_params": {
                    "max_new_tokens": leader_tokens}}  # fmt: skip
                first = asyncio.create_task(post(f"{url}/generate", leader))

                async def started() -> bool:
                    return bool(events)

                await until(started)
                burst = [asyncio.create_task(post(f"{url}/generate", follower)) for _ in range(3)]

                async def all_follow() -> bool:
                    return await followed(url) == 3

                await until(all_follow)
                assert len(events) == 1, "a follower did not wait for the prompt"
                release.set()
                answers = await asyncio.gather(*burst)
                assert all(status == 200 for status, _ in [*answers, await first])
        handed_off = leader_tokens > 16
        # The handoff's prefill step asks one token, then its serve step is a fourth request.
        assert events == [f"computing {1 if handed_off else 5}", "computed"] + ["served"] * (
            3 + handed_off
        )

    asyncio.run(scenario())


def test_a_stream_that_breaks_ends_with_an_error_event() -> None:
    async def break_mid_stream(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"text": "partial"}\n\n')
        await asyncio.sleep(0.1)
        assert request.transport is not None
        request.transport.abort()  # the instance dies mid-stream
        return out

    async def scenario() -> None:
        async with upstream(break_mid_stream) as port:
            specs = [InstanceSpec("decode-0", DECODE, port)]
            async with gateway_for(specs) as url:
                status, text = await post(f"{url}/generate", {"text": "hi", "stream": True})
        assert status == 200
        assert text.startswith('data: {"text": "partial"}')
        assert '"error"' in text and "failed mid-stream" in text
        assert text.rstrip().endswith("data: [DONE]")

    asyncio.run(scenario())


def test_clear_caches_flushes_every_instance_then_the_store_and_the_index() -> None:
    flushed: list[str] = []
    busy: set[str] = set()
    store = {"pages": 7, "down": False}

    def clear_store() -> int:
        if store["down"]:
            raise KvStoreError("kv store shard tcp://h:1 is down")
        dropped, store["pages"] = store["pages"], 0
        return dropped

    def flush(name: str) -> Handler:
        async def handler(_: web.Request) -> web.Response:
            if name in busy:  # what SGLang answers while it serves requests
                return web.Response(status=400, text="Cache not flushed: running requests")
            flushed.append(name)
            return web.Response(text="Cache flushed.")

        return handler

    async def clear(url: str) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/clear_caches", headers=ADMIN) as response:
                return response.status, await response.json()

    async def scenario() -> None:
        async with (
            upstream(answer_ok, flush("p")) as p,
            upstream(answer_ok, flush("d")) as d,
        ):
            specs = [InstanceSpec("prefill-0", PREFILL, p), InstanceSpec("decode-0", DECODE, d)]
            async with gateway_for(specs, clear_store=clear_store) as url:
                assert (await post(f"{url}/generate", LONG))[0] == 200  # indexed: 500 chars
                status, counts = await clear(url)
                assert status == 200, counts
                assert counts == {"instances_flushed": 2, "store_pages_dropped": 7,
                                  "prompt_index_chars_dropped": len(LONG["text"])}  # fmt: skip
                assert sorted(flushed) == ["d", "p"]
                assert (await clear(url))[1]["prompt_index_chars_dropped"] == 0
                # The index was forgotten: the same long prompt is handed off again.
                status, text = await post(f"{url}/generate", LONG)
                assert status == 200
                busy.add("d")
                store["down"] = True
                status, error = await clear(url)
                assert status == 500
                assert "flush failed on" in error["message"] and str(d) in error["message"]
                assert "the KV store was not cleared: kv store shard" in error["message"]
                assert "'prompt_index_chars_dropped': 500" in error["message"]  # done anyway
            async with gateway_for(specs) as url:  # no store: nothing to drop there
                busy.clear()
                assert (await clear(url)) == (200, {"instances_flushed": 2,
                    "store_pages_dropped": 0, "prompt_index_chars_dropped": 0})  # fmt: skip

    asyncio.run(scenario())


def test_without_a_store_every_request_runs_whole_on_the_least_loaded_instance() -> None:
    seen: list[tuple[int, int]] = []  # (port, max_new_tokens) per request an instance got
    both_arrived = asyncio.Event()

    def recording(port_of: Callable[[], int]) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            body = await request.json()
            seen.append((port_of(), body["sampling_params"]["max_new_tokens"]))
            if len(seen) == 2:
                both_arrived.set()
            # Busy until both requests were placed, so the second sees the first's load.
            await asyncio.wait_for(both_arrived.wait(), timeout=30)
            return web.json_response({"text": "ok"})

        return handler

    async def scenario() -> None:
        ports: dict[str, int] = {}
        async with (
            upstream(recording(lambda: ports["p"])) as ports["p"],
            upstream(recording(lambda: ports["d"])) as ports["d"],
        ):
            specs = [InstanceSpec("prefill-0", PREFILL, ports["p"]),
                     InstanceSpec("decode-0", DECODE, ports["d"])]  # fmt: skip
            board = LoadBoard(specs)
            gateway = Gateway(
                board, make_policy("load_aware", PREFILL), make_policy("load_aware", DECODE),
                placer=NoStorePlacer(),
            )  # fmt: skip
            runner = web.AppRunner(gateway.app())
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                long_output = {"text": LONG["text"], "sampling_params": {"max_new_tokens": 99}}
                results = await asyncio.gather(
                    *(post(f"http://127.0.0.1:{port}/generate", long_output) for _ in range(2))
                )
                assert [status for status, _ in results] == [200, 200]
                state = gateway.cluster_state()
            finally:
                await runner.cleanup()
        # No prefill step (max_new_tokens 1), and the two concurrent requests went to both
        # instances, the prefill one included, though each generates 99 tokens.
        assert sorted(seen) == sorted([(ports["p"], 99), (ports["d"], 99)])
        assert state["handoffs"] is False and state["gateway"]["handoffs"] == 0
        assert state["gateway"]["direct"] == 2

    asyncio.run(scenario())


def test_a_cluster_without_a_store_plans_no_store(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BANASERVE_PLATFORM", "cpu")
    argv = ["--model-path", str(tiny_model), "--num-prefill", "1", "--num-decode", "2",
            "--kv-store", "none", "--max-total-tokens", "4096"]  # fmt: skip
    plan = plan_launch(argv)
    assert plan.cluster is not None and plan.kv_store is None  # not even an embedded one
    assert "--page-size" not in plan.sglang_argv  # the store's page size is not needed
    instance = instance_launch_argv(argv, plan.kv_store, [], str(tiny_model), 3, 0.3)
    assert not any(a.startswith("--kv-store") for a in instance) and "none" not in instance
    assert float(instance[instance.index("--kv-pool-memory-fraction") + 1]) == pytest.approx(0.1)
    alone = plan_launch(instance)  # what each instance makes of it: no store flags at all
    assert alone.cluster is None and alone.kv_store is None
    assert not any("hicache" in a or "linker" in a for a in alone.sglang_argv)
    memory = memory_plan(plan.flags, plan.kv_store, str(tiny_model), 3)
    assert memory is not None and memory.store_bytes == 0 and memory.host_pool_bytes == 0
    # One instance: --kv-store none is no --kv-store.
    single = ["--model-path", str(tiny_model), "--max-total-tokens", "4096"]
    none = plan_launch([*single, "--kv-store", "none"])
    assert none.kv_store is None and none.sglang_argv == plan_launch(single).sglang_argv


def test_free_ports_are_outside_the_ephemeral_range() -> None:
    import socket

    from banaserve.utils.processes import _ephemeral_range

    for _ in range(5):
        port = free_port()
        assert port not in _ephemeral_range()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # really free


def test_the_admin_token_is_the_flag_the_environment_or_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stat

    from banaserve.cluster.credentials import ADMIN_TOKEN_FILE, admin_token_for
    from banaserve.env import ADMIN_TOKEN_ENV

    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-env")
    assert admin_token_for("from-flag", tmp_path) == "from-flag"
    assert admin_token_for(None, tmp_path) == "from-env"
    assert not (tmp_path / ADMIN_TOKEN_FILE).exists()
    monkeypatch.delenv(ADMIN_TOKEN_ENV)
    token = admin_token_for(None, tmp_path)
    path = tmp_path / ADMIN_TOKEN_FILE
    assert len(token) >= 32 and path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = admin_token_for(None, tmp_path)  # a restart in the same folder: a new token
    assert again != token and path.read_text().strip() == again
