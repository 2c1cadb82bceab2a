"""Unit tests of the router's load records and policies, on synthetic loads."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from banaserve.router import (
    POLICY_NAMES,
    ApproxRadixTree,
    CacheAwarePolicy,
    InstanceLoad,
    LoadAwarePolicy,
    NoHealthyInstance,
    Policy,
    RoundRobinPolicy,
    load_aware_decode,
    load_aware_prefill,
    make_policy,
    with_inflight,
)

SYSTEM_PROMPT = (
    "You are a meticulous assistant. Answer with care, cite sources, and keep every reply "
    "short. The following conversation is between a user and the assistant. " * 4
)


def prefill(url: str, **kw: object) -> InstanceLoad:
    return InstanceLoad(url=url, role="prefill", **kw)  # type: ignore[arg-type]


def decode(url: str, **kw: object) -> InstanceLoad:
    return InstanceLoad(url=url, role="decode", kv_capacity_tokens=10_000, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# InstanceLoad


def test_instance_load_derived_and_json_roundtrip() -> None:
    load = InstanceLoad(
        url="http://a",
        role="decode",
        healthy=True,
        queued_reqs=2,
        running_reqs=5,
        queued_prefill_tokens=0,
        kv_used_tokens=2500,
        kv_capacity_tokens=10_000,
        gen_tokens_per_s=812.5,
        updated_at=12.0,
    )
    assert load.kv_free_tokens == 7500
    assert load.kv_usage == pytest.approx(0.25)
    assert load.batch_reqs == 7
    assert load.age_s(15.5) == pytest.approx(3.5)
    data = load.to_json()
    assert data["kv_free_tokens"] == 7500 and data["url"] == "http://a"
    assert InstanceLoad.from_json(data) == load


def test_instance_load_validates() -> None:
    with pytest.raises(ValueError, match="role"):
        InstanceLoad(url="http://a", role="router")
    with pytest.raises(ValueError, match="queued_reqs"):
        InstanceLoad(url="http://a", role="prefill", queued_reqs=-1)
    # Used beyond capacity (reports race) must not give negative free KV.
    raced = InstanceLoad(url="a", role="decode", kv_used_tokens=9, kv_capacity_tokens=5)
    assert raced.kv_free_tokens == 0


def test_with_inflight_takes_max_of_report_and_gateway() -> None:
    stale = prefill("http://a", queued_reqs=1, running_reqs=1, queued_prefill_tokens=100)
    merged = with_inflight(stale, inflight_reqs=5, inflight_prefill_tokens=900)
    assert merged.queued_prefill_tokens == 900
    # 5 known in flight, 2 reported: the 3 unseen ones count as queued.
    assert (merged.queued_reqs, merged.running_reqs) == (4, 1)
    # The report is larger (work the gateway did not send): the report wins.
    busy = prefill("http://a", queued_reqs=10, running_reqs=4, queued_prefill_tokens=5000)
    assert with_inflight(busy, inflight_reqs=3, inflight_prefill_tokens=200) == busy
    assert stale.queued_prefill_tokens == 100  # the original record is untouched
    with pytest.raises(ValueError):
        with_inflight(stale, -1, 0)


# --------------------------------------------------------------------------------------------
# load_aware


def test_load_aware_prefill_picks_least_queued_tokens_despite_cache_affinity() -> None:
    prompts = [SYSTEM_PROMPT + f"Question {i}: what is {i} squared?" for i in range(4)]
    cache_aware = CacheAwarePolicy("prefill")
    a, b = prefill("http://a"), prefill("http://b")
    for p in prompts[:3]:
        assert cache_aware.choose([a, b], p).url == "http://a"
    # a has the affinity (cache_aware keeps sending the shared prefix there), but a queue.
    a_loaded = prefill("http://a", queued_prefill_tokens=4096, queued_reqs=3)
    b_idle = prefill("http://b", queued_prefill_tokens=0)
    assert cache_aware.choose([a_loaded, b_idle], prompts[3]).url == "http://a"
    assert load_aware_prefill([a_loaded, b_idle]).url == "http://b"
    policy = LoadAwarePolicy("prefill")
    for p in prompts:
        assert policy.choose([a_loaded, b_idle], p).url == "http://b"


def test_load_aware_prefill_tie_breaks() -> None:
    a = prefill("http://a", queued_prefill_tokens=300, queued_reqs=1, running_reqs=3)
    b = prefill("http://b", queued_prefill_tokens=300, queued_reqs=1, running_reqs=1)
    c = prefill("http://c", queued_prefill_tokens=301)
    assert load_aware_prefill([c, a, b]).url == "http://b"  # fewer requests
    b2 = prefill("http://b", queued_prefill_tokens=300, queued_reqs=2, running_reqs=2)
    assert load_aware_prefill([b2, a, c]).url == "http://a"  # then url
    assert load_aware_prefill([a, b2, c]).url == "http://a"  # order-independent


def test_load_aware_spreads_a_burst_with_gateway_accounting() -> None:
    # Metrics are polled: during a burst every report still says idle. With the gateway's
    # in-flight accounting merged in, the burst spreads; cache_aware piles it onto one.
    reports = {u: prefill(u) for u in ("http://a", "http://b", "http://c")}
    inflight_tokens = dict.fromkeys(reports, 0)
    inflight_reqs = dict.fromkeys(reports, 0)
    policy, cache_aware = LoadAwarePolicy("prefill"), CacheAwarePolicy("prefill")
    ca_choices = Counter()
    for i in range(9):
        prompt = SYSTEM_PROMPT + f"Request {i}"
        merged = [
            with_inflight(r, inflight_reqs[u], inflight_tokens[u]) for u, r in reports.items()
        ]
        url = policy.choose(merged, prompt).url
        inflight_reqs[url] += 1
        inflight_tokens[url] += len(prompt)
        ca_choices[cache_aware.choose(list(reports.values()), prompt).url] += 1
    assert sorted(inflight_reqs.values()) == [3, 3, 3]
    assert sorted(ca_choices.values()) == [9]


def test_load_aware_decode_ordering() -> None:
    small_batch = decode("http://a", running_reqs=4, kv_used_tokens=6000)
    big_batch = decode("http://b", running_reqs=8, kv_used_tokens=1000)
    assert load_aware_decode([big_batch, small_batch]).url == "http://a"
    # Queued requests will join the batch: they count.
    queued = decode("http://a", running_reqs=4, queued_reqs=5, kv_used_tokens=6000)
    assert load_aware_decode([big_batch, queued]).url == "http://b"
    # Equal batches: the most free KV.
    more_kv = decode("http://c", running_reqs=4, kv_used_tokens=2000)
    assert load_aware_decode([small_batch, more_kv]).url == "http://c"
    # A nearly full pool is not spare capacity, however short its batch.
    full = decode("http://d", running_reqs=1, kv_used_tokens=9500)
    assert load_aware_decode([full, big_batch]).url == "http://b"
    # Unknown capacity is "no information", not "full".
    unknown = InstanceLoad(url="http://e", role="decode", running_reqs=2)
    assert load_aware_decode([unknown, big_batch]).url == "http://e"
    assert LoadAwarePolicy("decode").choose([big_batch, small_batch], "x").url == "http://a"


def test_unhealthy_skipped_and_no_healthy_raises() -> None:
    sick = prefill("http://a", healthy=False)
    busy = prefill("http://b", queued_prefill_tokens=10_000)
    assert load_aware_prefill([sick, busy]).url == "http://b"
    sick_d = decode("http://a", healthy=False)
    busy_d = decode("http://b", running_reqs=50)
    assert load_aware_decode([sick_d, busy_d]).url == "http://b"
    for role, policy_name in [("prefill", n) for n in POLICY_NAMES] + [("decode", "load_aware")]:
        policy = make_policy(policy_name, role)
        with pytest.raises(NoHealthyInstance, match=f"no healthy {role} instance") as info:
            policy.choose([InstanceLoad(url="http://x", role=role, healthy=False)], "hi")
        assert info.value.role == role and info.value.num_candidates == 1
        with pytest.raises(NoHealthyInstance, match="0 candidate"):
            policy.choose([], "hi")


# --------------------------------------------------------------------------------------------
# round robin


def test_round_robin_cycles_and_skips_unhealthy() -> None:
    rr = RoundRobinPolicy("decode")
    a, b, c = (decode(u) for u in ("http://a", "http://b", "http://c"))
    assert [rr.choose([c, a, b], "p").url for _ in range(4)] == [
        "http://a",
        "http://b",
        "http://c",
        "http://a",
    ]
    b_sick = decode("http://b", healthy=False)
    picks = [rr.choose([a, b_sick, c], "p").url for _ in range(4)]
    assert "http://b" not in picks and Counter(picks) == {"http://a": 2, "http://c": 2}


def test_round_robin_thread_safe() -> None:
    rr = RoundRobinPolicy("prefill")
    loads = [prefill(f"http://{i}") for i in range(3)]
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            url = rr.choose(loads, "p").url
            with lock:
                counts[url] += 1

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(counts.values()) == [400, 400, 400]


# --------------------------------------------------------------------------------------------
# cache_aware


def test_cache_aware_defaults_match_sglang_router() -> None:
    policy = make_policy("cache_aware", "prefill")
    assert isinstance(policy, CacheAwarePolicy)
    assert (policy.cache_threshold, policy.balance_abs_threshold) == (0.3, 64)
    assert policy.balance_rel_threshold == 1.5 and policy.max_tree_size == 2**26


def test_cache_aware_hotspot_on_shared_prefix() -> None:
    policy = CacheAwarePolicy("prefill")
    workers = [prefill(u) for u in ("http://a", "http://b", "http://c", "http://d")]
    first = policy.choose(workers, SYSTEM_PROMPT + "What is the capital of France?").url
    urls = {policy.choose(workers, SYSTEM_PROMPT + f"Tell me fact #{i}.").url for i in range(40)}
    assert urls == {first}
    assert policy.inflight(first) == 41
    for w in workers:
        if w.url != first:
            assert policy.inflight(w.url) == 0


def test_cache_aware_balances_when_both_thresholds_exceeded() -> None:
    policy = CacheAwarePolicy("prefill")
    a, b = prefill("http://a"), prefill("http://b")
    # 65 shared-prefix requests all go to a (the hotspot); by then a has 65 in flight and b 0.
    chosen = [policy.choose([a, b], SYSTEM_PROMPT + f"#{i}").url for i in range(65)]
    assert set(chosen) == {"http://a"}
    # 65 - 0 > 64 and 65 > 0 * 1.5: imbalanced, so shortest queue despite the cache match.
    assert policy.choose([a, b], SYSTEM_PROMPT + "#65").url == "http://b"
    # Finishing requests on a restores balance, and with it the affinity.
    for _ in range(10):
        policy.on_done("http://a", "")
    assert policy.inflight("http://a") == 55
    assert policy.choose([a, b], "novel prompt nobody sent before").url == "http://b"


def test_cache_aware_abs_threshold_alone_does_not_balance() -> None:
    policy = CacheAwarePolicy("prefill")
    a, b = prefill("http://a"), prefill("http://b")
    policy.choose([a], SYSTEM_PROMPT + "seed")
    for _ in range(299):
        policy.choose([a], "filler a")
    for _ in range(210):
        policy.choose([b], "filler b")
    # 300 - 210 = 90 > 64, but 300 <= 210 * 1.5: balanced, so the cache match wins.
    assert policy.choose([a, b], SYSTEM_PROMPT + "question").url == "http://a"
    for _ in range(10):
        policy.on_done("http://b", "filler b")
    # 301 - 200 > 64 and 301 > 300: now imbalanced.
    assert policy.choose([a, b], SYSTEM_PROMPT + "question 2").url == "http://b"


def test_cache_aware_novel_prompt_goes_to_smallest_tree() -> None:
    policy = CacheAwarePolicy("prefill")
    a, b, c = prefill("http://a"), prefill("http://b"), prefill("http://c")
    policy.choose([a], "x" * 500)
    policy.choose([b], "y" * 50)
    policy.choose([c], "z" * 200)
    for url in ("http://a", "http://b", "http://c"):
        policy.on_done(url, "")
    assert policy.choose([a, b, c], "A brand new prompt.").url == "http://b"
    # 30% is the threshold: a prompt matching a's text for <= 30% is still a miss...
    assert policy.choose([a, b, c], "x" * 30 + "q" * 70).url == "http://b"
    # ...and one matching more than 30% is a hit, whatever the tree sizes.
    assert policy.choose([a, b, c], "x" * 31 + "q" * 69).url == "http://a"


def test_cache_aware_skips_unhealthy_even_with_affinity() -> None:
    policy = CacheAwarePolicy("decode")
    a, b = decode("http://a"), decode("http://b")
    assert policy.choose([a, b], SYSTEM_PROMPT).url == "http://a"
    a_sick = decode("http://a", healthy=False)
    assert policy.choose([a_sick, b], SYSTEM_PROMPT).url == "http://b"


def test_cache_aware_on_done_never_negative() -> None:
    policy = CacheAwarePolicy("prefill")
    policy.on_done("http://never-seen", "p")
    a = prefill("http://a")
    policy.choose([a], "p")
    policy.on_done("http://a", "p")
    policy.on_done("http://a", "p")
    assert policy.inflight("http://a") == 0


def test_approx_radix_tree_match_split_and_lru_eviction() -> None:
    tree = ApproxRadixTree()
    tree.insert("hello world", 1)
    tree.insert("hello there", 2)
    assert tree.size == len("hello ") + len("world") + len("there")
    assert tree.match_len("hello thorn") == len("hello th")
    assert tree.match_len("help") == 3
    assert tree.match_len("") == 0
    tree.insert("goodbye", 3)
    assert tree.evict_to(100) == 0
    # "world" (stamp 1) is the least recently used leaf.
    assert tree.evict_to(tree.size - 1) == len("world")
    assert tree.match_len("hello world") == len("hello ")
    tree.insert("hello there", 4)  # refreshes "hello " and "there"
    tree.evict_to(len("hello there"))
    assert tree.match_len("goodbye") == 0 and tree.match_len("hello there") == 11
    tree.evict_to(0)
    assert tree.size == 0 and tree.match_len("hello") == 0


def test_cache_aware_periodic_eviction_on_clock() -> None:
    now = [0.0]
    policy = CacheAwarePolicy(
        "prefill", max_tree_size=100, eviction_interval_s=10.0, clock=lambda: now[0]
    )
    a = prefill("http://a")
    policy.choose([a], "o" * 80)
    policy.choose([a], "n" * 80)
    assert policy.tree_size("http://a") == 160  # over the limit until the next eviction
    now[0] = 10.0
    policy.choose([a], "")  # eviction runs inside choose once the interval has passed
    assert policy.tree_size("http://a") == 80
    tree_only_new = CacheAwarePolicy("prefill")
    assert tree_only_new.tree_size("http://a") == 0


# --------------------------------------------------------------------------------------------
# make_policy


def test_make_policy() -> None:
    assert POLICY_NAMES == ("load_aware", "cache_aware", "round_robin")
    for name in POLICY_NAMES:
        policy = make_policy(name, "decode")
        assert isinstance(policy, Policy) and policy.name == name
    assert isinstance(make_policy("load_aware", "prefill"), LoadAwarePolicy)
    assert isinstance(make_policy("round_robin", "mixed"), RoundRobinPolicy)
    with pytest.raises(ValueError, match="load_aware, cache_aware, round_robin"):
        make_policy("random", "prefill")
    with pytest.raises(ValueError, match="role"):
        make_policy("load_aware", "router")
