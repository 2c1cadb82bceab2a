"""Roles as preferences: a long request runs on a prefill instance whose cores are spare, and
a prompt takes that instance back."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from banaserve.api.request_validation import GENERATE
from banaserve.router import (
    SERVE_ON_SPARE_PREFILL,
    Board,
    InstanceLoad,
    Placer,
    RequestShape,
    Role,
    Router,
    make_policy,
    spare_prefill_or,
)

MIN = 256
CHAT = "You are a helpful assistant. " * 80  # a cached system prompt: no handoff


def load(url: str, role: str, reqs: int = 0, queued_tokens: int = 0, peers: int = 0,
         healthy: bool = True, kv_used: int = 0,
         handoff_tokens: int = 0) -> InstanceLoad:  # fmt: skip
    return InstanceLoad(url, role, healthy, running_reqs=reqs, queued_prefill_tokens=queued_tokens,
                        core_peer_reqs=peers, kv_capacity_tokens=1000 if kv_used else 0,
                        kv_used_tokens=kv_used, queued_handoff_tokens=handoff_tokens)  # fmt: skip


DECODE_BUSY = load("d0", "decode", reqs=2)


@pytest.mark.parametrize(
    ("prefill", "chosen"),
    [
        # prefill-1 has a core to itself and nothing on it: the long request goes there.
        ([load("p1", "prefill")], "p1"),
        # As many requests on its cores as on the decode instance's: the decode keeps it.
        ([load("p1", "prefill", reqs=2)], "d0"),
        # prefill-0 shares decode-0's core (its neighbours' requests count): never spare.
        ([load("p0", "prefill", peers=2)], "d0"),
        # A handoff's prompt waits there for its prefill step: the prompt comes first.
        ([load("p1", "prefill", queued_tokens=MIN, handoff_tokens=MIN)], "d0"),
        # Direct requests' own prompts, however long, do not close it.
        ([load("p1", "prefill", reqs=1, queued_tokens=4 * MIN)], "p1"),
        # Unhealthy or KV saturated: not spare.
        ([load("p1", "prefill", healthy=False)], "d0"),
        ([load("p1", "prefill", kv_used=950)], "d0"),
        # Of two spare ones, the fewest requests on its cores.
        ([load("p0", "prefill", reqs=1), load("p1", "prefill")], "p1"),
        ([], "d0"),
    ],
)  # fmt: skip
def test_a_long_request_takes_a_spare_prefill_core_only(
    prefill: list[InstanceLoad], chosen: str
) -> None:
    assert spare_prefill_or(DECODE_BUSY, prefill).url == chosen


@dataclass(frozen=True)
class Spec:
    name: str
    role: str
    url: str
    cores: tuple[int, ...]


def router_2p1d(on: bool = SERVE_ON_SPARE_PREFILL, policy: str = "load_aware") -> Router:
    """The default layout on two cores: prefill-0 and decode-0 share core 0."""
    board = Board([Spec("prefill-0", "prefill", "http://p0", (0,)),
                   Spec("prefill-1", "prefill", "http://p1", (1,)),
                   Spec("decode-0", "decode", "http://d0", (0,))], lambda: 0.0)  # fmt: skip
    return Router(board, make_policy(policy, Role.PREFILL), make_policy(policy, Role.DECODE),
                  Placer(MIN), serve_on_spare_prefill=on)  # fmt: skip


def chat(turn: int, max_new_tokens: int = 48) -> RequestShape:
    text = CHAT + f"question {turn}"
    return RequestShape(GENERATE, text, len(text) // 4, False, max_new_tokens)


def serve(router: Router, shape: RequestShape):  # noqa: ANN201
    plan = router.plan(shape)
    assert not plan.handoff and not plan.any_role  # cached prompt, long output
    return router.pick(Role.DECODE, shape, any_role=False, prefill_tokens=plan.uncached_tokens)


def test_long_outputs_alternate_between_the_two_cores() -> None:
    assert SERVE_ON_SPARE_PREFILL  # on by default
    router = router_2p1d()
    router.plan(chat(0, 0))  # the system prompt is computed once (a cache fill)
    picks = [serve(router, chat(turn)) for turn in range(1, 7)]
    assert [p.url for p in picks] == ["http://d0", "http://p1"] * 3
    assert [p.role for p in picks[1::2]] == [Role.PREFILL] * 3
    for pick, turn in zip(picks, range(1, 7), strict=True):
        router.done(pick, chat(turn))


def test_a_prompt_takes_the_prefill_instance_back() -> None:
    router = router_2p1d()
    router.plan(chat(0, 0))
    first = serve(router, chat(1))  # decode-0
    # A new document to summarise in a few tokens arrives: it runs whole (no handoff for 8
    # tokens) on prefill-1, the core owing the fewest output tokens, and leads.
    document = RequestShape(GENERATE, "A new document. " * 400, 1600, False, 8)
    plan = router.plan(document)
    assert plan.leads and not plan.handoff
    lead = router.pick(Role.DECODE, document, any_role=True,
                      prefill_tokens=plan.uncached_tokens, leads=True)  # fmt: skip
    assert lead.url == "http://p1"
    # While its prompt is computed there, long requests stay on decode-0 though core 1 owes
    # fewer tokens: the prompt comes first.
    second = serve(router, chat(2))
    assert second.url == "http://d0"
    router.done(router.first_token(lead), document)
    # The prompt is computed: the very next long request takes prefill-1 again (no dwell).
    third = serve(router, chat(3))
    assert third.url == "http://p1"
    for pick, turn in ((first, 1), (second, 2), (third, 3)):
        router.done(pick, chat(turn))


@pytest.mark.parametrize(("on", "policy"), [(False, "load_aware"), (True, "round_robin")])
def test_off_or_under_a_baseline_policy_long_requests_stay_on_decode(on: bool, policy: str) -> None:
    router = router_2p1d(on, policy)
    router.plan(chat(0, 0))
    assert {serve(router, chat(turn)).url for turn in range(1, 5)} == {"http://d0"}


def test_a_burst_of_uncached_long_requests_alternates_between_the_two_cores() -> None:
    """16 long requests with prompts of their own (too short for a handoff) arrive at once:
    each books its prompt where it goes, and that must not close prefill-1 to the next ones
    (it did: 3 of 16 went there, the rest queued on decode-0's core)."""
    router = router_2p1d()
    shapes = [RequestShape(GENERATE, f"{i} " + "words of a prompt " * 50, MIN - 6, False, 200)
              for i in range(16)]  # fmt: skip
    picks = []
    for shape in shapes:
        plan = router.plan(shape)
        assert not plan.handoff and not plan.any_role
        picks.append(router.pick(Role.DECODE, shape, prefill_tokens=plan.uncached_tokens))
    assert [p.url for p in picks] == ["http://d0", "http://p1"] * 8


#: Output lengths of a burst as decode_heavy draws them (48 to 256).
LENGTHS = [256, 48, 200, 64, 180, 90, 250, 50, 120, 130, 60, 240, 70, 210, 100, 150]


def test_a_burst_splits_the_output_tokens_owed_evenly_between_the_cores() -> None:
    """Each long request goes to the core owing fewer tokens, so both cores finish together:
    alternating by count would leave decode-0's core owing 1,236 tokens and prefill-1's 982."""
    router = router_2p1d()
    owed = {"http://d0": 0, "http://p1": 0}
    for i, n in enumerate(LENGTHS):
        shape = RequestShape(GENERATE, f"{i} " + "words of a prompt " * 50, MIN - 6, False, n)
        plan = router.plan(shape)
        owed[router.pick(Role.DECODE, shape, prefill_tokens=plan.uncached_tokens).url] += n
    assert sum(owed.values()) == sum(LENGTHS)
    assert abs(owed["http://d0"] - owed["http://p1"]) <= 120  # 1,166 and 1,052


def test_a_handoffs_serve_step_takes_a_spare_prefill_core() -> None:
    router = router_2p1d()
    document = RequestShape(GENERATE, "A new document. " * 400, 1600, False, 48)
    router.done(router.pick(Role.PREFILL, document), document)  # its handoff's prefill step
    router.plan(chat(0, 0))
    serve(router, chat(1))  # decode-0 holds one, prefill-1's core none
    assert router.pick(Role.DECODE, document).url == "http://p1"


def document(i: int, max_new_tokens: int = 128) -> RequestShape:
    """A prompt of its own, long enough for a handoff, with a long output."""
    text = f"Document {i}. " + "A sentence of a new document. " * 60
    return RequestShape(GENERATE, text, 2 * MIN, False, max_new_tokens)


def test_a_long_request_that_would_decode_on_a_spare_prefill_core_runs_there_whole() -> None:
    """Handed off, its prompt would go to prefill-1 (the freer core) and its decode to
    decode-0 (never where it was prefilled), leaving prefill-1's core idle once prompts end."""
    router = router_2p1d()
    router.plan(chat(0, 0))
    first = serve(router, chat(1))  # decode-0's core owes 48 tokens, prefill-1's none
    plan = router.plan(document(0))
    assert not plan.handoff and plan.spilled and not plan.any_role
    assert plan.uncached_tokens == 2 * MIN  # its prompt is computed where it runs
    pick = router.pick(Role.DECODE, document(0), prefill_tokens=plan.uncached_tokens)
    assert (pick.url, pick.role) == ("http://p1", Role.PREFILL)
    for done, shape in ((first, chat(1)), (pick, document(0))):
        router.done(done, shape)


@pytest.mark.parametrize(("on", "policy"), [(False, "load_aware"), (True, "round_robin")])
def test_off_or_under_a_baseline_policy_a_long_uncached_request_is_handed_off(
    on: bool, policy: str
) -> None:
    router = router_2p1d(on, policy)
    router.plan(chat(0, 0))
    serve(router, chat(1))
    assert router.plan(document(0)).handoff


def test_a_long_request_is_handed_off_while_no_prefill_core_is_spare() -> None:
    router = router_2p1d()
    # An idle cluster: decode-0 is the first choice of a long request, and its prompt would
    # stall no decode there, so it runs there whole (a spill, :mod:`banaserve.router.spill`).
    assert router.plan(document(0)).spilled
    router.plan(chat(0, 0))
    serve(router, chat(1))
    # A handoff's prompt waits at prefill-1: the prompt comes first, the next one is handed off.
    other = document(1)
    assert router.pick(Role.PREFILL, other).url == "http://p1"
    assert router.plan(document(2)).handoff


def test_uncached_long_requests_decode_on_both_cores() -> None:
    """compare.py's uniform_long, every prompt a handoff's size: before, 10 of 11 decoded on
    decode-0. Now a request runs whole on prefill-1 whenever its core owes less, and is
    handed off to decode-0 otherwise, so the two cores owe the same."""
    router = router_2p1d()
    owed = {"http://d0": 0, "http://p1": 0}
    for i in range(8):
        shape = document(i)
        plan = router.plan(shape)
        if plan.handoff:
            prefill = router.pick(Role.PREFILL, shape)
            router.done(router.first_token(prefill), shape)
            router.prefilled(shape)
            pick = router.pick(Role.DECODE, shape, prefilled_on=prefill.url)
        else:
            pick = router.pick(Role.DECODE, shape, prefill_tokens=plan.uncached_tokens)
        owed[pick.url] += shape.max_new_tokens
    assert owed == {"http://d0": 4 * 128, "http://p1": 4 * 128}


def test_a_handoffs_serve_step_never_takes_the_core_of_the_instance_that_prefilled_it() -> None:
    """The handoff moves its decode off the instance that computed its prompt."""
    router = router_2p1d()
    document = RequestShape(GENERATE, "A new document. " * 400, 1600, False, 48)
    router.plan(chat(0, 0))
    serve(router, chat(1))  # decode-0 holds one, prefill-1's core none
    pick = router.pick(Role.DECODE, document, prefilled_on="http://p1")
    assert pick.url == "http://d0"


def test_a_retry_does_not_go_back_to_the_prefill_instance_it_tried() -> None:
    router = router_2p1d()
    router.plan(chat(0, 0))
    serve(router, chat(1))  # decode-0 holds one
    shape = chat(2)
    router.plan(shape)
    pick = router.pick(Role.DECODE, shape, tried={"http://p1"})
    assert pick.url == "http://d0"


#: The cores of router_2p1d's instances.
CORE = {"http://p0": 0, "http://p1": 1, "http://d0": 0}


def test_an_opening_burst_of_new_conversations_runs_two_on_each_core() -> None:
    """compare.py's chat opens with 4 new conversations at once, each a prompt of its own
    worth a handoff and 24 output tokens. The first one runs whole on the idle decode-0 (its
    prompt stalls no decode there), the second whole on the spare prefill-1, and so on: one
    handoff at most, and each core computes two prompts and decodes two requests. Before,
    3 of 4 were handed off, the first with its prompt on prefill-0, beside decode-0."""
    router = router_2p1d()
    prompts_on: dict[str, int] = {}
    decodes_on: dict[str, int] = {}
    handoffs = []
    for i in range(4):
        shape = document(i, 24)
        plan = router.plan(shape)
        if plan.handoff:
            prefill = router.pick(Role.PREFILL, shape)
            handoffs.append((shape, prefill))
            prompts_on[shape.prompt] = CORE[prefill.url]
        else:
            pick = router.pick(Role.DECODE, shape, prefill_tokens=plan.uncached_tokens)
            prompts_on[shape.prompt] = decodes_on[shape.prompt] = CORE[pick.url]
    assert len(handoffs) <= 1
    for shape, prefill in handoffs:  # the prefill steps end; the serve steps are placed
        router.done(prefill, shape)
        router.prefilled(shape)
        serve = router.pick(Role.DECODE, shape, prefilled_on=prefill.url)
        decodes_on[shape.prompt] = CORE[serve.url]
    assert sorted(prompts_on.values()) == sorted(decodes_on.values()) == [0, 0, 1, 1]
