"""The attribution table's arithmetic: per-stage seconds and BanaServe's store seconds from two
scrapes of each instance's ``/metrics``."""

from __future__ import annotations

import pytest

import compare_attribution as attribution

BEFORE = """
sglang:queue_time_seconds_sum{model_name="m"} 1.0
sglang:per_stage_req_latency_seconds_sum{stage="prefill_forward"} 2.0
sglang:e2e_request_latency_seconds_count 3
sglang:e2e_request_latency_seconds_sum 9.0
sglang:time_to_first_token_seconds_sum 3.0
banaserve:kv_store_seconds_total{op="lookup"} 0.5
banaserve:kv_store_seconds_total{op="get"} 0.25
"""
AFTER = """
sglang:queue_time_seconds_sum{model_name="m"} 1.5
sglang:per_stage_req_latency_seconds_sum{stage="prefill_forward"} 3.0
sglang:per_stage_req_latency_seconds_sum{stage="prefill_chunked_forward"} 0.5
sglang:e2e_request_latency_seconds_count 5
sglang:e2e_request_latency_seconds_sum 15.0
sglang:time_to_first_token_seconds_sum 4.0
banaserve:kv_store_seconds_total{op="lookup"} 2.5
banaserve:kv_store_seconds_total{op="get"} 1.25
banaserve:kv_store_seconds_total{op="put"} 0.75
sglang:backuped_tokens_total 10
"""


def test_store_seconds_are_told_apart_from_the_stages() -> None:
    before, after = attribution.parse(BEFORE), attribution.parse(AFTER)
    out = attribution.attribute([before], [after], [True], kv_bytes=1000, gateway={"handoffs": 2})
    assert out.requests == 2 and out.queue_s == pytest.approx(0.5)
    assert out.prefill_s == pytest.approx(1.5) and out.decode_s == pytest.approx(5.0)
    assert out.store_lookup_s == pytest.approx(2.0) and out.store_get_s == pytest.approx(1.0)
    assert out.store_put_s == pytest.approx(0.75) and out.l3_put_mb == pytest.approx(0.01)
    assert out.handoffs == 2


def test_an_instance_that_does_not_answer_the_client_adds_no_decode_time() -> None:
    before, after = attribution.parse(BEFORE), attribution.parse(AFTER)
    out = attribution.attribute([before], [after], [False], kv_bytes=0)
    assert out.requests == 0 and out.decode_s == 0 and out.store_get_s == pytest.approx(1.0)


def test_cached_tokens_are_summed_and_told_apart_by_source() -> None:
    text = "\n".join([
        "# TYPE sglang:cached_tokens_total counter",
        'sglang:cached_tokens_total{cache_source="device",tp_rank="0"} 30',
        'sglang:cached_tokens_total{cache_source="storage",tp_rank="0"} 50',
        "",
    ])  # fmt: skip
    scrape = attribution.parse(text)
    assert scrape["sglang:cached_tokens_total", ""] == 80
    assert scrape["sglang:cached_tokens_total", "source=storage"] == 50
    assert attribution.delta({}, scrape, "sglang:cached_tokens_total", "source=storage") == 50
