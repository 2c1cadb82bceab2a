"""Where a system's request time goes: queue, prefill, handoff and decode, from the instances'
``/metrics`` (SGLang, ``--enable-metrics``) and BanaServe's gateway counters, as the change
over one workload.

SGLang 0.5.23 series used (every instance, summed over instances and label sets):

- ``sglang:queue_time_seconds_sum``: waiting in a scheduler's queue;
- ``sglang:per_stage_req_latency_seconds_sum{stage="prefill_forward"|"prefill_chunked_forward"}``:
  prompt computation;
- ``sglang:e2e_request_latency_seconds_sum`` minus ``sglang:time_to_first_token_seconds_sum``
  on the instances that answer the client (all but stock PD's prefill instances): decoding;
- ``sglang:backuped_tokens_total`` and ``sglang:prefetched_tokens_total``: KV pages written to
  and read from HiCache's L3 (BanaServe's store, or SGLang's ``file`` backend), as tokens,
  turned into bytes with the model's KV bytes per token;
- ``sglang:kv_transfer_total_mb_sum`` and ``sglang:kv_transfer_latency_ms_sum``: stock PD's
  KV transfer (Mooncake), where it reports them.

and BanaServe's ``banaserve:kv_store_seconds_total{op}``
(:mod:`banaserve.sglang_ext.store_metrics`): the seconds its instances spent looking pages up
in the store (with the wait for pages another instance is computing: a handoff's wait for its
prefill), reading them and writing them.
"""

from __future__ import annotations

import json
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

PREFILL_STAGES = ("prefill_forward", "prefill_chunked_forward")
STORE_SECONDS = "banaserve:kv_store_seconds_total"

#: One instance's scrape: (sample name, its ``stage`` or ``op`` label) -> value summed over its
#: label sets.
Scrape = dict[tuple[str, str], float]


def scrape(url: str) -> Scrape:
    """``url/metrics`` parsed ({} if it does not answer)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            return parse(response.read().decode())
    except OSError:
        return {}


def parse(text: str) -> Scrape:
    """Prometheus text summed per sample name and ``stage`` (or ``op``) label, and per
    ``cache_source`` as ``source=NAME``; histogram buckets are skipped."""
    out: Scrape = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                label = sample.labels.get("stage") or sample.labels.get("op", "")
                out[sample.name, label] += sample.value
                source = sample.labels.get("cache_source")
                if source:  # cached tokens: by source too (device, host, storage)
                    out[sample.name, f"source={source}"] += sample.value
    return dict(out)


def delta(before: Scrape, after: Scrape, name: str, stage: str = "") -> float:
    # A restarted instance starts its counters at 0 again: count its whole "after" then.
    now, then = after.get((name, stage), 0.0), before.get((name, stage), 0.0)
    return now - then if now >= then else now


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """K and V of every layer for one token (0 if the model's config cannot be read)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = 4 if dtype in ("float32", "float") else 2
    return 2 * config["num_hidden_layers"] * heads * head_dim * width


@dataclass
class Attribution:
    """Seconds and bytes of one system on one workload, summed over its requests and instances."""

    requests: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    #: KV written to / read from a shared L3 (BanaServe's store, SGLang's file backend), MB.
    l3_put_mb: float = 0.0
    l3_get_mb: float = 0.0
    #: Stock PD's KV transfer (Mooncake), MB and seconds.
    transfer_mb: float = 0.0
    transfer_s: float = 0.0
    #: BanaServe's store calls: lookups (with their waits for pages being computed elsewhere:
    #: the handoff's wait), reads and writes, seconds. Writes run off the request's path.
    store_lookup_s: float = 0.0
    store_get_s: float = 0.0
    store_put_s: float = 0.0
    #: BanaServe's gateway: requests sent through the prefill -> store -> decode handoff,
    #: run whole on one instance, and held to follow another's prefill.
    handoffs: int = 0
    direct: int = 0
    followed: int = 0


def attribute(
    before: list[Scrape], after: list[Scrape], answering: list[bool], kv_bytes: int,
    gateway: dict[str, int] | None = None,
) -> Attribution:  # fmt: skip
    """The change between two scrapes of every instance; ``answering[i]``: instance ``i``
    streams the output to the client (its e2e latency minus its TTFT is decode time)."""
    out = Attribution()
    for b, a, answers in zip(before, after, answering, strict=True):
        out.queue_s += delta(b, a, "sglang:queue_time_seconds_sum")
        out.prefill_s += sum(
            delta(b, a, "sglang:per_stage_req_latency_seconds_sum", s) for s in PREFILL_STAGES
        )
        if answers:
            out.requests += round(delta(b, a, "sglang:e2e_request_latency_seconds_count"))
            out.decode_s += delta(b, a, "sglang:e2e_request_latency_seconds_sum") - delta(
                b, a, "sglang:time_to_first_token_seconds_sum"
            )
        out.l3_put_mb += delta(b, a, "sglang:backuped_tokens_total") * kv_bytes / 1e6
        out.l3_get_mb += delta(b, a, "sglang:prefetched_tokens_total") * kv_bytes / 1e6
        out.transfer_mb += delta(b, a, "sglang:kv_transfer_total_mb_sum")
        out.transfer_s += delta(b, a, "sglang:kv_transfer_latency_ms_sum") / 1000
        out.store_lookup_s += delta(b, a, STORE_SECONDS, "lookup")
        out.store_get_s += delta(b, a, STORE_SECONDS, "get")
        out.store_put_s += delta(b, a, STORE_SECONDS, "put")
    if gateway:
        out.handoffs, out.direct = gateway.get("handoffs", 0), gateway.get("direct", 0)
        out.followed = gateway.get("followed", 0)
    return out


def gateway_counters(url: str) -> dict[str, int]:
    """BanaServe's gateway counters from ``/cluster`` ({} elsewhere)."""
    try:
        with urllib.request.urlopen(f"{url}/cluster", timeout=30) as response:
            return {k: int(v) for k, v in json.load(response)["gateway"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def print_attribution(rows: list[tuple[str, str, Attribution]]) -> None:
    """Per request, in ms (queue, prefill, decode, transfer, store calls) and MB (L3,
    transfer)."""
    print(f"\n{'system':<26}{'workload':<22}{'reqs':>5}{'queue ms':>10}{'prefill ms':>11}"
          f"{'decode ms':>10}{'L3 put MB':>10}{'L3 get MB':>10}{'PD xfer MB':>11}"
          f"{'xfer ms':>8}{'lookup ms':>10}{'get ms':>8}{'put ms':>8}"
          "  handoff/direct/followed")  # fmt: skip
    for system, workload, a in rows:
        n = max(1, a.requests)
        print(f"{system:<26}{workload:<22}{a.requests:>5}{1000 * a.queue_s / n:>10.0f}"
              f"{1000 * a.prefill_s / n:>11.0f}{1000 * a.decode_s / n:>10.0f}"
              f"{a.l3_put_mb / n:>10.1f}{a.l3_get_mb / n:>10.1f}{a.transfer_mb / n:>11.1f}"
              f"{1000 * a.transfer_s / n:>8.0f}{1000 * a.store_lookup_s / n:>10.0f}"
              f"{1000 * a.store_get_s / n:>8.0f}{1000 * a.store_put_s / n:>8.0f}"
              f"  {a.handoffs}/{a.direct}/{a.followed}")  # fmt: skip
