"""Unit tests of the routing core's facade and board: the router picks, books and unbooks
exactly as the gateway relies on, on an injected clock, and imports nothing of the cluster."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import banaserve.router
from banaserve.router import (
    Board,
    NoHealthyInstance,
    Placer,
    RequestShape,
    Role,
    Router,
    make_policy,
)

ROUTER_DIR = Path(banaserve.router.__file__).parent
FORBIDDEN = ("banaserve.cluster", "aiohttp", "asyncio")
LOADS = {"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 1}]}


@dataclass(frozen=True)
class Spec:
    name: str
    role: str
    url: str


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


SPECS = [Spec("prefill-0", "prefill", "http://p0"), Spec("prefill-1", "prefill", "http://p1"),
         Spec("decode-0", "decode", "http://d0")]  # fmt: skip


def shape(prompt: str = "hello world", tokens: int = 300, max_new_tokens: int = 8) -> RequestShape:
    return RequestShape("/generate", prompt, tokens, stream=False, max_new_tokens=max_new_tokens)


def make_router(policy: str = "load_aware", spill: bool = True) -> tuple[Router, Board, Clock]:
    clock = Clock()
    board = Board(SPECS, clock)
    router = Router(board, make_policy(policy, Role.PREFILL, clock),
                    make_policy(policy, Role.DECODE, clock), Placer(), spill)  # fmt: skip
    return router, board, clock


def test_router_package_imports_nothing_of_the_cluster_or_asyncio() -> None:
    offenders = []
    for path in sorted(ROUTER_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])  # fmt: skip
            offenders += [f"{path.name}: {n}" for n in names
                          if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]  # fmt: skip
    assert offenders == []


def test_role_is_its_name() -> None:
    assert Role.PREFILL == "prefill" and f"{Role.DECODE}" == "decode"
    assert Role("mixed") is Role.MIXED


def test_pick_books_the_request_until_done() -> None:
    router, board, _ = make_router()
    request = shape()
    pick = router.pick(Role.PREFILL, request)
    assert pick.step is Role.PREFILL and pick.role is Role.PREFILL
    assert pick.prefill_tokens == 300
    assert board.inflight_requests(pick.url) == 1
    # The booked prompt is queued prefill work: the next prefill goes to the other instance.
    other = router.pick(Role.PREFILL, shape("another prompt"))
    assert other.url != pick.url
    router.done(pick, request)
    router.done(other, request)
    assert board.inflight_requests(pick.url) == board.inflight_requests(other.url) == 0
    assert all(c.queued_prefill_tokens == 0 for c in board.candidates("prefill"))


def test_a_served_prompt_stops_counting_as_queued_at_its_first_token() -> None:
    router, board, _ = make_router()
    request = shape()
    pick = router.pick(Role.DECODE, request, any_role=True)  # a direct request, prompt uncached
    queued = {c.url: c.queued_prefill_tokens for c in board.candidates("decode")}
    assert queued[pick.url] == 300
    # Its first token came back: the prompt is computed, the request still decodes there.
    pick = router.first_token(pick)
    load = next(c for c in board.candidates("decode") if c.url == pick.url)
    assert (load.queued_prefill_tokens, board.inflight_requests(pick.url)) == (0, 1)
    router.done(pick, request)
    assert board.inflight_requests(pick.url) == 0
    assert all(c.queued_prefill_tokens == 0 for c in board.candidates("decode"))


def test_decode_step_skips_tried_and_honours_only() -> None:
    router, board, _ = make_router()
    request = shape()
    first = router.pick(Role.DECODE, request, prefill_tokens=0)
    assert first.url == "http://d0" and first.step is Role.DECODE and not first.fallback
    router.done(first, request)
    with pytest.raises(NoHealthyInstance):
        router.pick(Role.DECODE, request, tried={"http://d0"})
    # A suspect request goes back to one (restarted) instance only, whatever its role.
    back = router.pick(Role.DECODE, request, {"http://d0", "http://p1"}, only="http://p1")
    assert back.url == "http://p1" and back.role is Role.PREFILL
    router.done(back, request)


def test_short_direct_requests_balance_over_every_instance() -> None:
    router, _, _ = make_router()
    picks = [router.pick(Role.DECODE, shape(f"q{i}"), any_role=True, prefill_tokens=10)
             for i in range(3)]  # fmt: skip
    assert {p.url for p in picks} == {"http://p0", "http://p1", "http://d0"}
    assert not any(p.fallback for p in picks)


@dataclass(frozen=True)
class PinnedSpec(Spec):
    cores: tuple[int, ...] = ()


def test_requests_that_may_run_anywhere_go_to_the_least_busy_core() -> None:
    # BanaServe's 2P+1D on two cores: prefill-0 and decode-0 time-share core 0.
    specs = [PinnedSpec("prefill-0", "prefill", "http://p0", (0,)),
             PinnedSpec("prefill-1", "prefill", "http://p1", (1,)),
             PinnedSpec("decode-0", "decode", "http://d0", (0,))]  # fmt: skip
    board = Board(specs, Clock())
    policy = make_policy("load_aware", Role.DECODE)
    router = Router(board, make_policy("load_aware", Role.PREFILL), policy, Placer())
    board.begin("http://p0", 0)  # a prefill step runs on core 0
    load = {c.url: c for c in board.candidates("decode")}["http://d0"]
    assert (load.batch_reqs, load.core_peer_reqs, load.core_reqs) == (0, 1, 1)
    # decode-0's own batch is empty, but its core is not: a long request that may run anywhere
    # goes to prefill-1, alone on core 1.
    first = router.pick(Role.DECODE, shape("a"), any_role=True, prefill_tokens=0)
    assert first.url == "http://p1"
    # Now both cores hold one request: the tie goes by free KV, then url (decode-0 first).
    second = router.pick(Role.DECODE, shape("b"), any_role=True, prefill_tokens=0)
    assert second.url == "http://d0"
    # A long request goes to the less busy core too, prefill-1's, since no prompt waits there
    # (router/spare_prefill.py); with roles as walls it stays on decode-0.
    assert router.pick(Role.DECODE, shape("c"), prefill_tokens=0).url == "http://p1"
    router.serve_on_spare_prefill = False
    assert router.pick(Role.DECODE, shape("d"), prefill_tokens=0).url == "http://d0"
    # An instance out of routing adds nothing to its neighbours' cores.
    board.mark_dead("http://p0")
    assert {c.url: c.core_peer_reqs for c in board.candidates("decode")} == {"http://d0": 0}


def test_unpinned_instances_share_no_core() -> None:
    board = Board(SPECS, Clock())
    board.begin("http://p0", 0)
    assert [c.core_peer_reqs for c in board.candidates("decode")] == [0]


def test_prefill_instances_serve_when_no_decode_instance_is_healthy() -> None:
    router, board, _ = make_router()
    board.mark_dead("http://d0")
    pick = router.pick(Role.DECODE, shape())
    assert pick.fallback and pick.role is Role.PREFILL and pick.step is Role.DECODE
    board.mark_dead("http://p0")
    board.mark_dead("http://p1")
    assert not router.can_prefill()
    with pytest.raises(NoHealthyInstance):
        router.pick(Role.DECODE, shape())


def test_done_tells_the_policy_that_picked() -> None:
    router, _, _ = make_router("cache_aware")
    request = shape()
    pick = router.pick(Role.DECODE, request, only="http://p0")  # the decode policy's pick
    assert router.decode_policy.inflight("http://p0") == 1  # type: ignore[attr-defined]
    router.done(pick, request)
    assert router.decode_policy.inflight("http://p0") == 0  # type: ignore[attr-defined]
    assert router.prefill_policy.inflight("http://p0") == 0  # type: ignore[attr-defined]


def test_board_stamps_records_with_its_clock_and_takes_failures_out_of_routing() -> None:
    board = Board(SPECS, Clock())
    clock = board.clock
    assert isinstance(clock, Clock)
    clock.now = 250.0
    board.record_poll(SPECS[2], LOADS)
    load = board.loads["http://d0"]
    assert (load.running_reqs, load.queued_reqs, load.updated_at) == (3, 1, 250.0)
    for _ in range(2):
        board.record_poll(SPECS[2], None, "refused")
    board.record_poll(SPECS[2], {"detail": "Not Found"})  # an answer it cannot read fails too
    assert board.healthy("decode") == []
    board.record_poll(SPECS[2], LOADS)
    assert [c.url for c in board.healthy("decode")] == ["http://d0"]
    board.mark_dead("http://d0")
    board.record_poll(SPECS[2], LOADS)  # a dead instance's poll is ignored
    assert board.healthy("decode") == []
    clock.now = 300.0
    board.revive("http://d0")
    assert board.loads["http://d0"].healthy and board.loads["http://d0"].updated_at == 300.0


def snapshot(published: float, running: int = 0) -> dict:
    return {"loads": [{"timestamp": published, "num_running_reqs": running}]}


def test_an_instance_holding_requests_without_progress_leaves_routing_until_it_moves() -> None:
    """Issue 31: a scheduler stopped with SIGSTOP kept answering /v1/loads from shared memory,
    so it stayed in routing and every request sent to it hung."""
    clock = Clock()
    board = Board(SPECS, clock, stall_after_s=10.0)
    d0 = SPECS[2]
    # Idle for a long time with the same snapshot: not stalled, it has nothing to do.
    for t in range(0, 60, 5):
        clock.now = 100.0 + t
        board.record_poll(d0, snapshot(1.0))
    assert not board.is_stalled(d0.url) and board.healthy("decode")
    # A request arrives and the snapshot moves on at every step: progress.
    board.begin(d0.url, 0)
    for t in range(60, 80, 5):
        clock.now = 100.0 + t
        board.record_poll(d0, snapshot(float(t), running=1))
    assert board.healthy("decode")
    # The scheduler stops: the snapshot stays put while it holds the request.
    clock.now = 184.0
    board.record_poll(d0, snapshot(75.0, running=1))
    assert board.healthy("decode")  # 9 s without progress: a long step, maybe
    gone = []
    board._left = gone.append  # type: ignore[method-assign]
    clock.now = 185.0
    board.record_poll(d0, snapshot(75.0, running=1))
    assert board.is_stalled(d0.url) and board.healthy("decode") == [] and gone == [d0.url]
    assert board.stats[d0.url].stalls == 1
    # Its requests retried elsewhere, it holds none by the router's count; the frozen
    # snapshot still says one: it stays out, and polls count it once.
    board.end(d0.url, 0)
    for t in (200.0, 260.0):
        clock.now = t
        board.record_poll(d0, snapshot(75.0))
        assert board.healthy("decode") == [] and board.stats[d0.url].stalls == 1
    # A probe got a token through: back at the next poll, and not stalled again at once.
    board.unstalled(d0.url)
    clock.now = 261.0
    board.record_poll(d0, snapshot(75.0, running=1))
    assert board.healthy("decode") and not board.is_stalled(d0.url)
    # A new snapshot brings a stalled instance back too.
    clock.now = 300.0
    board.record_poll(d0, snapshot(75.0, running=1))
    assert board.is_stalled(d0.url)
    board.record_poll(d0, snapshot(76.0, running=1))
    assert board.healthy("decode") and board.stats[d0.url].stalls == 2


def test_stall_detection_is_off_at_zero_and_without_timestamps() -> None:
    for stall_after_s, answer in [(0.0, snapshot(1.0, running=1)), (10.0, LOADS)]:
        clock = Clock()
        board = Board(SPECS, clock, stall_after_s=stall_after_s)
        for t in range(0, 100, 5):
            clock.now = 100.0 + t
            board.record_poll(SPECS[2], answer)
        assert board.healthy("decode")


def test_plan_and_reset_go_through_the_placer() -> None:
    router, _, _ = make_router(spill=False)  # every long uncached prompt is handed off
    prompt = "You are a helpful assistant. " * 100
    long_ = shape(prompt, tokens=700, max_new_tokens=64)  # short requests are never handed off
    first = router.plan(long_)
    assert first.handoff
    router.prefilled(long_)
    assert not router.plan(long_).handoff  # the prefix is now cached
    assert router.reset() > 0
    assert router.plan(long_).handoff
