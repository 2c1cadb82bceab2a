"""What an instance's reply says about its prompt, read by the gateway from whole and streamed
answers, and a conversation's next turn told apart from its first."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from banaserve.api.request_validation import CHAT, GENERATE
from banaserve.cluster.load_board import LoadBoard
from banaserve.cluster.relay_bodies import StreamTail, computed_prompt_tokens
from banaserve.cluster.topology import DECODE, InstanceSpec
from banaserve.router.request_shape import shape_request
from support.gateway import ADMIN, Handler, gateway_for, post, upstream


def events(*payloads: object) -> list[bytes]:
    return [f"data: {json.dumps(p)}\n\n".encode() for p in payloads] + [b"data: [DONE]\n\n"]


def test_a_generate_stream_reports_its_last_events_counts() -> None:
    tail = StreamTail()
    for i in range(1, 4):
        tail.add(events({"text": "x" * i, "meta_info": {"prompt_tokens": 40,
                                                      "cached_tokens": 10 * i}})[0])  # fmt: skip
    tail.add(b"data: [DONE]\n\n")
    assert tail.prompt_tokens(GENERATE) == (40, 30)


def test_a_chat_stream_reports_its_usage_chunk_only_when_it_has_one() -> None:
    delta = {"choices": [{"delta": {"content": "hi"}}], "usage": None}
    usage = {"choices": [], "usage": {"prompt_tokens": 50,
                                      "prompt_tokens_details": {"cached_tokens": 48}}}  # fmt: skip
    with_usage, without = StreamTail(), StreamTail()
    for chunk in events(delta, delta, usage):
        with_usage.add(chunk)
    for chunk in events(delta, delta):
        without.add(chunk)
    assert with_usage.prompt_tokens(CHAT) == (50, 48)
    assert without.prompt_tokens(CHAT) == (0, 0)


def test_the_tail_is_bounded_and_an_event_cut_at_its_start_is_skipped() -> None:
    tail = StreamTail(limit=100)
    first = events({"meta_info": {"prompt_tokens": 1, "cached_tokens": 1}})[0]
    for _ in range(50):
        tail.add(first)
    last = events({"text": "y" * 200, "meta_info": {"prompt_tokens": 9, "cached_tokens": 3}})[0]
    tail.add(last)
    assert tail.prompt_tokens(GENERATE) == (9, 3)
    # Only the newest chunk and what fits beside it under the limit are kept.
    assert tail.size < len(last) + 100
    cut = StreamTail()
    cut.add(last[60:])  # the stream's tail begins mid-event: nothing to read from it
    assert cut.prompt_tokens(GENERATE) == (0, 0)


def test_whole_replies_and_batches_are_counted() -> None:
    reply = {"meta_info": {"prompt_tokens": 20, "cached_tokens": 16}}
    assert computed_prompt_tokens(GENERATE, [reply, reply]) == (40, 32)
    assert computed_prompt_tokens(CHAT, {"usage": {"prompt_tokens": 7}}) == (7, 0)


def test_a_chat_with_answers_in_its_history_is_a_next_turn() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    assert shape_request(CHAT, {"messages": first}).prior_turns == 0
    assert shape_request(CHAT, {"messages": later}).prior_turns == 1
    assert shape_request(GENERATE, {"text": "assistant"}).prior_turns == 0


def streaming_instance(release: asyncio.Event | None = None) -> Handler:
    """An instance that streams one event with its prompt counts (64, 48 cached), then
    ``[DONE]``, and closes the stream once ``release`` is set (at once without one)."""

    async def streamed(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for chunk in events({"text": "a", "meta_info": {"prompt_tokens": 64,
                                                       "cached_tokens": 48}}):  # fmt: skip
            await out.write(chunk)
        if release is not None:
            await release.wait()
        return out

    return streamed


def test_the_gateway_books_a_streamed_answers_prompt_tokens() -> None:
    async def scenario() -> None:
        async with upstream(streaming_instance()) as port:
            specs = [InstanceSpec("decode-0", DECODE, port)]
            board = LoadBoard(specs)
            async with gateway_for(specs, board) as url:
                status, text = await post(f"{url}/generate", {"text": "hi", "stream": True})
            stats = board.stats[specs[0].url]
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
        assert (stats.prompt_tokens, stats.computed_prompt_tokens) == (64, 16)

    asyncio.run(scenario())


def test_a_streams_end_is_seen_across_chunk_boundaries() -> None:
    tail = StreamTail()
    tail.add(events({"text": "a"})[0])
    assert not tail.ended
    tail.add(b"data: [DO")
    assert not tail.ended
    tail.add(b"NE]\n\n")
    assert tail.ended


def test_the_counts_are_booked_before_the_client_reads_the_streams_end() -> None:
    """A client that reads ``/cluster`` right after ``[DONE]`` sees its turn counted, even
    while the instance has not closed the stream yet."""
    release = asyncio.Event()

    async def scenario() -> None:
        async with upstream(streaming_instance(release)) as port:
            specs = [InstanceSpec("decode-0", DECODE, port)]
            board = LoadBoard(specs)
            async with (
                gateway_for(specs, board) as url,
                aiohttp.ClientSession(headers=ADMIN) as session,
                session.post(f"{url}/generate", json={"text": "hi", "stream": True}) as response,
            ):
                async for line in response.content:
                    if line.strip() == b"data: [DONE]":
                        break
                stats = board.stats[specs[0].url]
                booked = (stats.prompt_tokens, stats.computed_prompt_tokens)
                release.set()
        assert booked == (64, 16)

    asyncio.run(scenario())
