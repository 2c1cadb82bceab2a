"""The gateway's reading of an SGLang server's ``/v1/loads`` answer (router/loads_report.py)."""

from __future__ import annotations

import copy
import math

import pytest

from banaserve.router import InstanceLoad, load_from_loads

#: ``GET /v1/loads`` of SGLang 0.5.23 serving SmolLM2-135M on the CPU with 12 requests running
#: (captured from a real server, session 20).
BUSY = {
    "timestamp": "2026-12-05T17:15:03.045741+00:00",
    "version": "0.5.23",
    "accelerator": None,
    "num_accelerators": 1,
    "loads": [
        {
            "timestamp": 1796490902.9980593,
            "dp_rank": 0,
            "num_running_reqs": 12,
            "num_waiting_reqs": 0,
            "num_waiting_uncached_tokens": 0,
            "num_used_tokens": 364,
            "num_total_tokens": 364,
            "num_active_tokens": 364,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": 6144,
            "max_running_requests": 2048,
            "token_usage": 0.0592,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": 0.0,
            "total_prefill_uncached_tokens": 201,
            "total_prefill_busy_us": 716711,
            "decode_moments": [21.0, 186.0, 2435031.0, 2166.0, 25666701.0, 186.0],
            "memory": {
                "weight_gb": 0.465,
                "kv_cache_gb": 0.264,
                "graph_gb": 0.0,
                "token_capacity": 6144,
            },
            "disaggregation": {
                "mode": "null",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {
                "waiting": 0,
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            },
        }
    ],
}


def test_a_real_answer_reads_as_the_instances_load() -> None:
    load = load_from_loads("http://d0", "decode", BUSY, now=7.0)
    assert load == InstanceLoad(
        url="http://d0",
        role="decode",
        running_reqs=12,
        queued_reqs=0,
        queued_prefill_tokens=0,
        kv_used_tokens=364,
        kv_capacity_tokens=6144,
        gen_tokens_per_s=0.0,
        updated_at=7.0,
        published_at=1796490902.9980593,  # when the scheduler published it, its clock
    )


def test_queues_and_dp_ranks_add_up() -> None:
    rank0 = copy.deepcopy(BUSY["loads"][0])
    rank0.update(num_waiting_reqs=3, num_waiting_uncached_tokens=900, gen_throughput=40.5)
    rank0["queues"]["grammar"] = 2  # SGLang counts grammar waits apart from the waiting queue
    rank1 = dict(rank0, dp_rank=1, num_running_reqs=5, num_used_tokens=100, queues={},
                 timestamp=rank0["timestamp"] + 0.5)  # fmt: skip
    load = load_from_loads("http://p0", "prefill", {"loads": [rank0, rank1]}, now=1.0)
    assert (load.running_reqs, load.queued_reqs) == (17, 3 + 2 + 3)
    assert load.queued_prefill_tokens == 1800
    assert (load.kv_used_tokens, load.kv_capacity_tokens) == (464, 2 * 6144)
    assert load.gen_tokens_per_s == pytest.approx(81.0)
    assert load.published_at == rank1["timestamp"]  # the latest rank's


def test_missing_fields_read_as_zero() -> None:
    load = load_from_loads("http://m", "mixed", {"loads": [{"num_running_reqs": 2}]}, now=0.0)
    assert (load.running_reqs, load.queued_reqs, load.kv_capacity_tokens) == (2, 0, 0)
    assert load_from_loads("http://m", "mixed", {"loads": []}, now=0.0).batch_reqs == 0


@pytest.mark.parametrize(
    "answer",
    [
        None,
        [],
        "loads",
        {"detail": "Not Found"},
        {"loads": {"num_running_reqs": 1}},
        {"loads": [7]},
        {"loads": [{"num_running_reqs": -1}]},
        {"loads": [{"num_running_reqs": math.inf}]},
        {"loads": [{"num_running_reqs": math.nan}]},
        {"loads": [{"num_running_reqs": "3"}]},
        {"loads": [{"num_running_reqs": True}]},
        {"loads": [{"queues": [1]}]},
        {"loads": [{"queues": {"grammar": -2}}]},
    ],
)
def test_an_answer_of_the_wrong_shape_is_refused(answer: object) -> None:
    with pytest.raises(ValueError):
        load_from_loads("http://x", "decode", answer, now=0.0)
