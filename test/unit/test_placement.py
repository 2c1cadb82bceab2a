"""Placement: the handoff only for prompts the cluster has not computed, short requests on any
instance, and a bounded index of computed prompts."""

from __future__ import annotations

import pytest

from banaserve.api.request_validation import GENERATE
from banaserve.router.placement import NoStorePlacer, Placement, Placer, PromptIndex
from banaserve.router.request_shape import RequestShape

SYSTEM = "You are a careful assistant who answers in one word. " * 40  # about 2,100 chars


def shape(text: str, max_new_tokens: int | None = 64) -> RequestShape:
    return RequestShape(GENERATE, text, len(text) // 4, False, max_new_tokens)


def test_a_new_long_prompt_is_handed_off_and_its_followers_are_not() -> None:
    placer = Placer(handoff_min_tokens=256, in_place_max_new_tokens=16)
    first = placer.place(shape(SYSTEM + "What is 2+2?"))
    assert first.handoff and first.uncached_tokens == len(SYSTEM + "What is 2+2?") // 4
    follower = placer.place(shape(SYSTEM + "Name a colour.", 4))
    assert not follower.handoff and follower.any_role and not follower.leads
    assert 0 < follower.uncached_tokens < 10  # only the question is new
    again = placer.place(shape(SYSTEM + "Name a colour."))
    assert again.uncached_tokens == 0


@pytest.mark.parametrize(
    ("max_new_tokens", "any_role"), [(1, True), (16, True), (17, False), (None, False)]
)
def test_only_short_outputs_may_run_on_a_prefill_instance(
    max_new_tokens: int | None, any_role: bool
) -> None:
    placer = Placer(handoff_min_tokens=256, in_place_max_new_tokens=16)
    assert placer.place(shape("short prompt", max_new_tokens)).any_role is any_role


def test_thresholds() -> None:
    # 0 hands everything off that generates; max_new_tokens 0 only fills a cache.
    always = Placer(handoff_min_tokens=0)
    assert always.place(shape("hi")).handoff
    assert always.place(shape("hi")).handoff  # even when cached
    assert not always.place(shape(SYSTEM, max_new_tokens=0)).handoff
    # in_place_max_new_tokens 0: no request is short, so every uncached one is handed off.
    never_short = Placer(in_place_max_new_tokens=0)
    assert not never_short.place(shape("hi", 1)).any_role
    assert never_short.place(shape(SYSTEM, 1)).handoff
    with pytest.raises(ValueError, match="must not be negative"):
        Placer(handoff_min_tokens=-1)


def test_the_index_stays_bounded_and_forgets_the_oldest_first() -> None:
    index = PromptIndex(max_chars=10_000)
    prompts = [f"{i:04d} " + "x" * 995 for i in range(30)]
    for prompt in prompts:
        index.add(prompt)
        assert index.size_chars <= 10_000
    assert index.cached_fraction(prompts[-1]) == 1.0
    assert index.cached_fraction(prompts[0]) < 0.01
    assert index.cached_fraction("") == 0.0
    with pytest.raises(ValueError):
        PromptIndex(max_chars=0)


def test_a_short_request_is_never_handed_off_and_leads_when_its_prompt_is_new() -> None:
    placer = Placer(handoff_min_tokens=256, in_place_max_new_tokens=16)
    first = SYSTEM + "What is 2+2?"
    lead = placer.place(shape(first, 16))
    assert not lead.handoff and lead.leads and lead.any_role and lead.follows is None
    assert lead.uncached_tokens == len(first) // 4  # booked as the instance's prefill work
    # Requests sharing its prompt wait for it, short or long, until its first token.
    for max_new_tokens in (4, 64):
        follower = placer.place(shape(SYSTEM + "Name a colour.", max_new_tokens))
        assert follower.follows == first and not follower.leads and not follower.handoff
    placer.prefilled(first)
    assert placer.place(shape(SYSTEM + "Why?", 4)).follows is None
    # A short request whose prompt is mostly cached does not lead.
    assert not placer.place(shape(SYSTEM + "How?", 4)).leads


def test_a_direct_request_follows_the_pending_handoff_of_its_prefix() -> None:
    placer = Placer(handoff_min_tokens=256)
    first = SYSTEM + "What is 2+2?"
    assert placer.place(shape(first)).handoff
    follower = placer.place(shape(SYSTEM + "Name a colour."))
    assert follower.follows == first
    # A prompt sharing less than handoff_min_tokens with it does not wait.
    assert placer.place(shape(SYSTEM[:200] + "x" * 2000)).follows is None
    placer.prefilled(first)
    assert placer.place(shape(SYSTEM + "Name a colour.")).follows is None


def test_reset_forgets_every_prompt_and_pending_handoff() -> None:
    placer = Placer(handoff_min_tokens=256)
    first = SYSTEM + "What is 2+2?"
    assert placer.place(shape(first)).handoff
    assert placer.reset() == len(first) and placer.index.size_chars == 0
    # Cold again: the same prompt is handed off again, and nothing follows the old handoff.
    again = placer.place(shape(SYSTEM + "Name a colour."))
    assert again.handoff and again.follows is None
    placer.prefilled(first)  # the old handoff's prefill step ends after the reset: no error
    assert placer.place(shape(SYSTEM + "Why?")).follows == SYSTEM + "Name a colour."
    assert placer.reset() > 0 and placer.reset() == 0


def test_without_a_store_nothing_is_handed_off() -> None:
    placer = NoStorePlacer(handoff_min_tokens=0, in_place_max_new_tokens=0)
    assert Placer.hands_off and not placer.hands_off
    for max_new_tokens in (None, 0, 1, 5000):
        long = shape(SYSTEM + "What is 2+2?", max_new_tokens)
        placement = placer.place(long)
        # Whole on any instance, prefill ones too: the least loaded of all takes it.
        assert placement == Placement(False, long.prompt_tokens, True, None)
    assert placer.index.size_chars == 0 and placer.reset() == 0  # no index to keep
