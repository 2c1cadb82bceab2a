"""Read an SGLang 0.5.23 server's ``/metrics`` (``--enable-metrics``) into an InstanceLoad.

The metric names are those SGLang 0.5.23 registers in
``sglang/srt/observability/metrics_collector.py`` (``SchedulerMetricsCollector``); every series
carries the labels ``model_name``, ``engine_type`` (``unified``/``prefill``/``decode``),
``tp_rank``, ``pp_rank``, ``moe_ep_rank``, and, where enabled, ``dp_rank`` and ``priority``.

Gauges used (all prefixed ``sglang:``):

- ``num_running_reqs``: the running batch.
- ``num_queue_reqs``, ``num_grammar_queue_reqs``, and in PD mode
  ``num_prefill_bootstrap_queue_reqs``, ``num_decode_prealloc_queue_reqs``,
  ``num_decode_transfer_queue_reqs``: requests held but not running. These queues are
  disjoint in SGLang (a request moves from one to the next), so they add up.
- ``kv_used_tokens`` (KV slots locked by live requests), falling back to ``num_used_tokens``
  and then to ``token_usage`` x capacity on servers that lack it.
- ``max_total_num_tokens``: the KV pool size, set once at startup; falling back to
  ``kv_available_tokens + kv_evictable_tokens + kv_used_tokens`` (a lower bound).
- ``gen_throughput``: decode tokens/s.

``/metrics`` has no count of queued prompt *tokens* (SGLang's ``/v1/loads`` JSON does, as
``num_waiting_uncached_tokens``), so :func:`load_from_metrics` reports 0 and the gateway's own
accounting supplies it (:func:`banaserve.router.load.with_inflight`).

Aggregation across label sets, per metric name:

- Series that differ only in ``tp_rank``/``pp_rank``/``moe_ep_rank`` are replicas of one
  scheduler's view (SGLang logs from attention-TP rank 0 by default, from every rank with
  ``--enable-metrics-for-all-schedulers``): take their max, never their sum.
- Series that differ in anything else (``dp_rank`` above all: each DP rank has its own requests
  and KV pool) are summed; except ratios (``*_usage``, ``*_rate``, ``*_ratio``, ...), which are
  averaged.
- Per-priority breakdowns (``priority`` label non-empty) repeat the total under
  ``priority=""`` and are skipped, as are histogram buckets (``le``) and summary quantiles
  (``quantile``).

Parsing never raises: malformed lines and non-finite values are skipped; missing metrics read
as 0.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from banaserve.router.load import InstanceLoad

PREFIX = "sglang:"

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}

#: Labels whose values distinguish replicas of one scheduler's numbers, not separate load.
_REPLICA_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank"})
#: Labels that mark a breakdown of a series whose total is exported too.
_BREAKDOWN_LABELS = frozenset({"le", "quantile"})
_RATIO_SUFFIXES = ("_usage", "_rate", "_ratio", "utilization", "_occupancy")

_QUEUE_METRICS = (
    "num_queue_reqs",
    "num_grammar_queue_reqs",
    "num_prefill_bootstrap_queue_reqs",
    "num_decode_prealloc_queue_reqs",
    "num_decode_transfer_queue_reqs",
)

Labels = tuple[tuple[str, str], ...]


def _parse_labels(s: str, pos: int) -> tuple[dict[str, str], int] | None:
    """Parse ``{a="x",b="y"}`` starting at ``s[pos] == '{'``; returns (labels, end) or None."""
    labels: dict[str, str] = {}
    pos += 1
    n = len(s)
    while True:
        while pos < n and s[pos] in " \t,":
            pos += 1
        if pos < n and s[pos] == "}":
            return labels, pos + 1
        m = _LABEL_NAME_RE.match(s, pos)
        if m is None:
            return None
        name = m.group(0)
        pos = m.end()
        while pos < n and s[pos] in " \t":
            pos += 1
        if pos + 1 >= n or s[pos] != "=" or s[pos + 1] != '"':
            return None
        pos += 2
        value: list[str] = []
        while True:
            if pos >= n:
                return None
            ch = s[pos]
            if ch == "\\" and pos + 1 < n:
                value.append(_ESCAPES.get(s[pos + 1], "\\" + s[pos + 1]))
                pos += 2
            elif ch == '"':
                pos += 1
                break
            else:
                value.append(ch)
                pos += 1
        labels[name] = "".join(value)


def _parse_line(line: str) -> tuple[str, dict[str, str], float] | None:
    """One sample line -> (name, labels, value), or None if malformed or not finite."""
    m = _NAME_RE.match(line)
    if m is None:
        return None
    name = m.group(0)
    pos = m.end()
    labels: dict[str, str] = {}
    if pos < len(line) and line[pos] == "{":
        parsed = _parse_labels(line, pos)
        if parsed is None:
            return None
        labels, pos = parsed
    # An OpenMetrics exemplar (" # {...} v") may follow the value; a timestamp may too.
    rest = line[pos:].split(" # ", 1)[0].split()
    if not rest or len(rest) > 2 or (pos < len(line) and line[pos] not in " \t"):
        return None
    try:
        value = float(rest[0])
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    return name, labels, value


def _is_ratio(name: str) -> bool:
    return name.removeprefix(PREFIX).endswith(_RATIO_SUFFIXES)


def parse_sglang_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name (with ``sglang:``): aggregated value}.

    See the module docstring for how label sets are aggregated. Never raises on bad input.
    """
    # name -> group labels (replica labels dropped) -> max over replicas
    groups: dict[str, dict[Labels, float]] = defaultdict(dict)
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        sample = _parse_line(line)
        if sample is None:
            continue
        name, labels, value = sample
        if labels.get("priority") or _BREAKDOWN_LABELS & labels.keys():
            continue
        key = tuple(sorted((k, v) for k, v in labels.items() if k not in _REPLICA_LABELS))
        by_group = groups[name]
        by_group[key] = max(value, by_group.get(key, value))
    out: dict[str, float] = {}
    for name, by_group in groups.items():
        total = sum(by_group.values())
        out[name] = total / len(by_group) if _is_ratio(name) else total
    return out


def _count(value: float) -> int:
    return max(0, round(value))


def load_from_metrics(
    url: str, role: str, text: str, now: float, *, healthy: bool = True
) -> InstanceLoad:
    """Build the InstanceLoad of instance ``url`` from its ``/metrics`` text read at ``now``.

    ``healthy`` is the caller's verdict (it knows whether the scrape and health check
    succeeded); metrics absent from ``text`` read as 0. Raises only for an invalid ``role``.
    """
    metrics = parse_sglang_metrics(text)

    def get(name: str) -> float:
        return metrics.get(PREFIX + name, 0.0)

    capacity = get("max_total_num_tokens")
    if capacity <= 0:
        capacity = get("kv_available_tokens") + get("kv_evictable_tokens") + get("kv_used_tokens")
    if PREFIX + "kv_used_tokens" in metrics:
        used = get("kv_used_tokens")
    elif PREFIX + "num_used_tokens" in metrics:
        used = get("num_used_tokens")
    else:
        used = get("token_usage") * capacity
    return InstanceLoad(
        url=url,
        role=role,
        healthy=healthy,
        queued_reqs=_count(sum(get(name) for name in _QUEUE_METRICS)),
        running_reqs=_count(get("num_running_reqs")),
        queued_prefill_tokens=0,
        kv_used_tokens=_count(used),
        kv_capacity_tokens=_count(capacity),
        gen_tokens_per_s=max(0.0, get("gen_throughput")),
        updated_at=now,
    )
