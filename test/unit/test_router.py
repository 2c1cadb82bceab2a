"""Unit tests of the router's load records, metrics parser and policies, on synthetic loads."""

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
    load_from_metrics,
    make_policy,
    parse_sglang_metrics,
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


# --------------------------------------------------------------------------------------------
# metrics parsing

LABELS = 'engine_type="unified",model_name="tiny-llama",moe_ep_rank="0",pp_rank="0",tp_rank="0"'

# (name, type, HELP text as SGLang 0.5.23 registers it, value) for a one-rank unified server.
_GAUGES: list[tuple[str, str, str, str]] = [
    ("num_running_reqs", "gauge", "The number of running requests.", "7.0"),
    ("num_queue_reqs", "gauge", "The number of requests in the waiting queue.", "3.0"),
    (
        "num_grammar_queue_reqs",
        "gauge",
        "The number of requests in the grammar waiting queue.",
        "1.0",
    ),
    ("gen_throughput", "gauge", "The generation throughput (token/s).", "245.37"),
    ("cache_hit_rate", "gauge", "The prefix cache hit rate.", "0.42"),
    ("token_usage", "gauge", "The token usage.", "0.125"),
    ("num_used_tokens", "gauge", "The number of used tokens.", "2048.0"),
    (
        "kv_available_tokens",
        "gauge",
        "Number of free token slots in the KV cache pool.",
        "12000.0",
    ),
    (
        "kv_evictable_tokens",
        "gauge",
        "Number of evictable (radix-cached) token slots in the KV cache pool.",
        "2336.0",
    ),
    (
        "kv_used_tokens",
        "gauge",
        "Number of actively used token slots in the KV cache pool.",
        "2048.0",
    ),
    (
        "num_prefill_bootstrap_queue_reqs",
        "gauge",
        "The number of requests in the prefill bootstrap queue.",
        "0.0",
    ),
    (
        "num_decode_prealloc_queue_reqs",
        "gauge",
        "The number of requests in the decode prealloc queue.",
        "0.0",
    ),
    (
        "num_decode_transfer_queue_reqs",
        "gauge",
        "The number of requests in the decode transfer queue.",
        "0.0",
    ),
    ("fwd_occupancy", "gauge", "Forward pass GPU occupancy percentage.", "NaN"),
    (
        "max_total_num_tokens",
        "gauge",
        "Maximum total number of tokens in the KV cache pool.",
        "16384.0",
    ),
    ("prompt_tokens_total", "counter", "Number of prefill tokens processed.", "51234.0"),
]


def _exposition() -> str:
    lines = []
    for name, kind, help_text, value in _GAUGES:
        lines += [
            f"# HELP sglang:{name} {help_text}",
            f"# TYPE sglang:{name} {kind}",
            f"sglang:{name}{{{LABELS}}} {value}",
        ]
    ttft = "sglang:time_to_first_token_seconds"
    lines += [
        f"# HELP {ttft} Histogram of time to first token in seconds.",
        f"# TYPE {ttft} histogram",
        f'{ttft}_bucket{{{LABELS},le="0.1"}} 10.0',
        f'{ttft}_bucket{{{LABELS},le="+Inf"}} 12.0',
        f"{ttft}_sum{{{LABELS}}} 1.5",
        f"{ttft}_count{{{LABELS}}} 12.0",
        "# HELP process_resident_memory_bytes Resident memory size in bytes.",
        "# TYPE process_resident_memory_bytes gauge",
        "process_resident_memory_bytes 1.23456789e+09",
    ]
    return "\n".join(lines) + "\n"


SGLANG_METRICS = _exposition()


def test_parse_sglang_metrics_realistic_sample() -> None:
    m = parse_sglang_metrics(SGLANG_METRICS)
    assert m["sglang:num_running_reqs"] == 7.0
    assert m["sglang:num_queue_reqs"] == 3.0
    assert m["sglang:gen_throughput"] == pytest.approx(245.37)
    assert m["sglang:max_total_num_tokens"] == 16384.0
    assert m["sglang:time_to_first_token_seconds_count"] == 12.0
    assert "sglang:time_to_first_token_seconds_bucket" not in m  # buckets are skipped
    assert "sglang:fwd_occupancy" not in m  # NaN is skipped
    assert m["process_resident_memory_bytes"] == pytest.approx(1.23456789e9)

    load = load_from_metrics("http://p0", "prefill", SGLANG_METRICS, now=42.0)
    assert load == InstanceLoad(
        url="http://p0",
        role="prefill",
        healthy=True,
        queued_reqs=4,  # waiting 3 + grammar 1
        running_reqs=7,
        queued_prefill_tokens=0,  # /metrics has none: the gateway's accounting supplies it
        kv_used_tokens=2048,
        kv_capacity_tokens=16384,
        gen_tokens_per_s=245.37,  # float("245.37"): exact
        updated_at=42.0,
    )
    assert load.kv_free_tokens == 14336


def test_parse_aggregates_dp_ranks_not_tp_replicas_or_priorities() -> None:
    def series(name: str, value: float, dp: int, tp: int, priority: str = "") -> str:
        return (
            f'sglang:{name}{{dp_rank="{dp}",engine_type="decode",model_name="m",'
            f'moe_ep_rank="0",pp_rank="0",priority="{priority}",tp_rank="{tp}"}} {value}'
        )

    lines = []
    for dp, running in ((0, 5), (1, 9)):
        for tp in (0, 1):  # --enable-metrics-for-all-schedulers: every TP rank repeats it
            lines += [
                series("num_running_reqs", running, dp, tp),
                series("num_running_reqs", running - 1, dp, tp, priority="0"),
                series("kv_used_tokens", 1000 * (dp + 1), dp, tp),
                series("max_total_num_tokens", 8000, dp, tp),
                series("token_usage", 0.25 * (dp + 1), dp, tp),
            ]
    text = "\n".join(lines) + "\n"
    m = parse_sglang_metrics(text)
    assert m["sglang:num_running_reqs"] == 14.0  # 5 + 9: DP ranks add, TP copies don't
    assert m["sglang:kv_used_tokens"] == 3000.0
    assert m["sglang:max_total_num_tokens"] == 16000.0
    assert m["sglang:token_usage"] == pytest.approx(0.375)  # ratios average
    load = load_from_metrics("http://d0", "decode", text, now=1.0)
    assert (load.running_reqs, load.kv_used_tokens, load.kv_capacity_tokens) == (14, 3000, 16000)


def test_load_from_metrics_fallbacks() -> None:
    # An older server without kv_used_tokens / max_total_num_tokens.
    text = (
        f"sglang:num_used_tokens{{{LABELS}}} 500\n"
        f"sglang:kv_available_tokens{{{LABELS}}} 1500\n"
        f"sglang:kv_evictable_tokens{{{LABELS}}} 0\n"
    )
    load = load_from_metrics("http://m", "mixed", text, now=0.0)
    assert (load.kv_used_tokens, load.kv_capacity_tokens) == (500, 1500)
    ratio_only = f"sglang:token_usage{{{LABELS}}} 0.5\nsglang:max_total_num_tokens 4000\n"
    assert load_from_metrics("http://m", "mixed", ratio_only, now=0.0).kv_used_tokens == 2000


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "not a metric at all\n\x00\xff binary junk",
        "<html><body>502 Bad Gateway</body></html>",
        'sglang:num_running_reqs{tp_rank="0" 5\n',  # unterminated labels
        'sglang:num_running_reqs{tp_rank="0} 5\n',  # unterminated string
        "sglang:num_running_reqs{} five\n",
        "sglang:num_running_reqs 1 2 3 4\n",
        "sglang:num_running_reqs -Inf\nsglang:num_queue_reqs +Inf\n",
        "{}{}{} 1\n= 2\n# HELP only\n",
    ],
)
def test_parser_tolerates_garbage(garbage: str) -> None:
    m = parse_sglang_metrics(garbage)
    assert m == {}
    load = load_from_metrics("http://x", "decode", garbage, now=3.0)
    assert load == InstanceLoad(url="http://x", role="decode", updated_at=3.0)


def test_parser_keeps_good_lines_among_bad_and_odd_labels() -> None:
    text = (
        "garbage line\n"
        'sglang:num_queue_reqs{model_name="a \\"quoted\\", {braced} name",tp_rank="0"} 6\n'
        "sglang:num_running_reqs{broken 3\n"
        "sglang:num_running_reqs 2 1700000000000\n"  # with a timestamp
        'sglang:gen_throughput{tp_rank="0"} 12.5 # {trace_id="x"} 1.0\n'  # with an exemplar
        "sglang:kv_used_tokens -4\n"
    )
    m = parse_sglang_metrics(text)
    assert m == {
        "sglang:num_queue_reqs": 6.0,
        "sglang:num_running_reqs": 2.0,
        "sglang:gen_throughput": 12.5,
        "sglang:kv_used_tokens": -4.0,
    }
    load = load_from_metrics("http://x", "prefill", text, now=0.0)
    assert (load.queued_reqs, load.running_reqs, load.kv_used_tokens) == (6, 2, 0)


def test_parser_reads_prometheus_client_exposition() -> None:
    # The writer SGLang uses, so quoting, label order and float formatting are the real ones.
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    labels = {
        "model_name": "tiny",
        "engine_type": "decode",
        "tp_rank": "0",
        "pp_rank": "0",
        "moe_ep_rank": "0",
    }
    values = {
        "num_running_reqs": 12,
        "num_queue_reqs": 2,
        "num_decode_prealloc_queue_reqs": 3,
        "num_decode_transfer_queue_reqs": 1,
        "kv_used_tokens": 7000,
        "max_total_num_tokens": 20000,
        "gen_throughput": 1234.5,
    }
    for name, value in values.items():
        gauge = prom.Gauge(f"sglang:{name}", name, labelnames=labels.keys(), registry=registry)
        gauge.labels(**labels).set(value)
    ttft = prom.Histogram(
        "sglang:time_to_first_token_seconds", "ttft", labelnames=labels.keys(), registry=registry
    )
    ttft.labels(**labels).observe(0.2)
    text = prom.generate_latest(registry).decode()
    load = load_from_metrics("http://d1", "decode", text, now=5.0)
    assert (load.running_reqs, load.queued_reqs) == (12, 6)
    assert (load.kv_used_tokens, load.kv_capacity_tokens) == (7000, 20000)
    assert load.gen_tokens_per_s == 1234.5
