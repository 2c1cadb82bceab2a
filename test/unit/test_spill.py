"""Spilling: a long prompt runs whole on a freer serving instance when the prefill instance it
would be handed to is already prefilling, and only then."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from banaserve.api.request_validation import GENERATE
from banaserve.launch_server import plan_launch
from banaserve.router import (
    SPILL_PREFILL,
    Board,
    InstanceLoad,
    Placer,
    RequestShape,
    Role,
    Router,
    make_policy,
    prefill_backlogged,
    serving_idle,
)

MIN = 256
LONG = "An uncached document the cluster has never seen. " * 100  # about 1,250 tokens


def load(url: str, role: str, queued_tokens: int = 0, reqs: int = 0, peers: int = 0,
         healthy: bool = True) -> InstanceLoad:  # fmt: skip
    return InstanceLoad(url, role, healthy, queued_reqs=reqs,
                        queued_prefill_tokens=queued_tokens, core_peer_reqs=peers)  # fmt: skip


@pytest.mark.parametrize(
    ("prefill", "serve", "spills"),
    [
        # 1P+1D: the prefill instance computes one prompt, the decode core is idle.
        ([load("p0", "prefill", 1024, 1)], [load("d0", "decode")], True),
        # The prefill instance is idle: the prompt does not wait, so it is handed off.
        ([load("p0", "prefill", 0, 0)], [load("d0", "decode")], False),
        # Less than one handoff's worth queued (a short prompt's tail): no wait worth a spill.
        ([load("p0", "prefill", MIN - 1, 1)], [load("d0", "decode")], False),
        # The decode core is as busy as the prefill one: queueing costs no more than stalling.
        ([load("p0", "prefill", 1024, 1)], [load("d0", "decode", 0, 1)], False),
        # 2P+1D on two cores: the prompt would go to the idle prefill-1, so it is handed off.
        ([load("p0", "prefill", 1024, 1), load("p1", "prefill")], [load("d0", "decode")], False),
        # decode-0 shares its core with a busy prefill-0: that core is not free.
        ([load("p0", "prefill", 1024, 1, peers=0), load("p1", "prefill", 1024, 1)],
         [load("d0", "decode", peers=1)], False),
        # Two prompts queued on each prefill core, one decode on decode-0's: it spills there.
        ([load("p0", "prefill", 2048, 2), load("p1", "prefill", 2048, 2)],
         [load("d0", "decode", 0, 1)], True),
        # An unhealthy serving instance takes nothing; no healthy one: no spill.
        ([load("p0", "prefill", 1024, 1)], [load("d0", "decode", healthy=False)], False),
        ([], [load("d0", "decode")], False),
    ],
)  # fmt: skip
def test_a_long_output_spills_only_when_it_would_wait_and_a_decode_core_is_freer(
    prefill: list[InstanceLoad], serve: list[InstanceLoad], spills: bool
) -> None:
    assert prefill_backlogged(prefill, serve, MIN) is spills


@pytest.mark.parametrize(
    ("serve", "idle"),
    [
        ([load("d0", "decode")], True),
        # One request queued or running on its cores, its own or a core neighbour's: it has
        # a decode to protect (or soon will).
        ([load("d0", "decode", reqs=1)], False),
        ([load("d0", "decode", peers=1)], False),
        # Any one idle serving instance will do; an unhealthy one takes nothing.
        ([load("d0", "decode", reqs=2), load("d1", "decode")], True),
        ([load("d0", "decode", healthy=False)], False),
        ([], False),
    ],
)  # fmt: skip
def test_a_long_prompt_spills_onto_an_idle_serving_instance(
    serve: list[InstanceLoad], idle: bool
) -> None:
    assert serving_idle(serve) is idle


def shape(text: str = LONG, max_new_tokens: int | None = 64) -> RequestShape:
    return RequestShape(GENERATE, text, len(text) // 4, False, max_new_tokens)


def test_a_spilled_prompt_runs_direct_and_its_twins_wait_for_it() -> None:
    placer = Placer(handoff_min_tokens=MIN)
    spilled = placer.place(shape(), spill=True)
    assert spilled.spilled and spilled.followed and not spilled.handoff
    assert spilled.uncached_tokens == len(LONG) // 4  # booked as the instance's prefill work
    assert not spilled.any_role  # 64 output tokens: on a decode instance, as a handoff's
    # A twin finds the prompt indexed, and waits for it (its first token) rather than
    # computing it again, as it would for a handoff's: hotspot_long's burst on a new system
    # prompt, first spilled onto the idle decode-0, queued 286 ms a request against 45 while
    # the twins did not (RESULTS.md, session 30).
    twin = placer.place(shape(LONG + "?"), spill=True)
    assert not twin.handoff and not twin.spilled and twin.follows == LONG
    placer.prefilled(LONG)  # its first token
    assert placer.place(shape(LONG + "!"), spill=True).follows is None
    # A request that needs no handoff is never marked spilled, nor is a short one (it leads).
    assert not placer.place(shape("short"), spill=True).spilled
    short = placer.place(shape("B" + LONG, 4), spill=True)
    assert short.leads and not short.spilled


@dataclass(frozen=True)
class Spec:
    name: str
    role: str
    url: str
    cores: tuple[int, ...]


def router_1p1d(spill: bool = SPILL_PREFILL) -> tuple[Router, Board]:
    board = Board([Spec("prefill-0", "prefill", "http://p0", (1,)),
                   Spec("decode-0", "decode", "http://d0", (0,))], lambda: 0.0)  # fmt: skip
    router = Router(board, make_policy("load_aware", Role.PREFILL),
                    make_policy("load_aware", Role.DECODE), Placer(MIN), spill)  # fmt: skip
    return router, board


def test_the_router_spills_onto_an_idle_decode_core_and_one_freer_than_the_prefill_core() -> None:
    assert SPILL_PREFILL  # on by default
    router, _ = router_1p1d()
    # Different documents (none shares a prefix worth following), long outputs.
    first, second, third, fourth = (shape(f"{c}" + LONG, 64) for c in "ABCE")
    # An idle cluster: the prompt stalls no decode on decode-0, so it runs whole there.
    plan = router.plan(first)
    assert plan.spilled and not plan.handoff
    whole = router.pick(Role.DECODE, first, any_role=plan.any_role,
                        prefill_tokens=plan.uncached_tokens)  # fmt: skip
    assert whole.url == "http://d0"
    # decode-0 decodes, prefill-0's core is spare: the next one runs whole there
    # (:mod:`banaserve.router.spare_prefill`).
    plan = router.plan(second)
    assert plan.spilled and not plan.handoff
    spare = router.pick(Role.DECODE, second, prefill_tokens=plan.uncached_tokens)
    assert spare.url == "http://p0"
    # Both cores hold one request, prefill-0 a prompt: queueing behind it costs no more than
    # stalling decode-0, so the next long-output prompt is handed off...
    assert router.plan(third).handoff
    prefill = router.pick(Role.PREFILL, third)
    assert prefill.url == "http://p0"
    # ...and with two prompts on prefill-0's core, one request on decode-0's, the next one
    # spills onto decode-0.
    plan = router.plan(fourth)
    assert plan.spilled and not plan.handoff
    assert router.pick(Role.DECODE, fourth, prefill_tokens=plan.uncached_tokens).url == "http://d0"
    # A short-output one runs whole on either instance (the fewest on its cores).
    short = shape("D" + LONG, 4)
    plan = router.plan(short)
    assert plan.leads and plan.any_role and not plan.handoff
    assert router.pick(Role.DECODE, short, any_role=True).url in {"http://p0", "http://d0"}
    for pick, done in ((whole, first), (spare, second), (prefill, third)):
        router.done(pick, done)


def test_without_spilling_every_long_prompt_is_handed_off() -> None:
    router, _ = router_1p1d(spill=False)
    first = shape("A" + LONG)
    router.plan(first)
    router.pick(Role.PREFILL, first)
    assert router.plan(shape("B" + LONG)).handoff and router.plan(shape("C" + LONG, 99)).handoff


def test_the_command_line_sets_spilling(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BANASERVE_PLATFORM", "cpu")
    argv = ["--model-path", str(tiny_model), "--num-prefill", "1", "--num-decode", "1",
            "--max-total-tokens", "4096"]  # fmt: skip
    default = plan_launch(argv).cluster
    assert default is not None and default.spill_prefill is SPILL_PREFILL
    off = plan_launch([*argv, "--spill-prefill", "off"]).cluster
    assert off is not None and off.spill_prefill is False
    with pytest.raises(SystemExit):
        plan_launch([*argv, "--spill-prefill", "maybe"])
