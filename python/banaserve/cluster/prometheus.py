"""The gateway's ``/metrics``: each instance's load report and the gateway's counters in the
Prometheus text format (version 0.0.4)."""

from __future__ import annotations

from typing import Any

from banaserve.cluster.migration_loop import migration_metrics

#: (metric, help, key in the load record)
INSTANCE_GAUGES = (
    ("banaserve_instance_healthy", "1 if the instance is in routing", "healthy"),
    ("banaserve_instance_queued_requests", "Requests waiting in the instance", "queued_reqs"),
    ("banaserve_instance_running_requests", "Requests in the running batch", "running_reqs"),
    ("banaserve_instance_queued_prefill_tokens", "Prompt tokens waiting to be prefilled",
     "queued_prefill_tokens"),
    ("banaserve_instance_kv_used_tokens", "KV pool tokens in use", "kv_used_tokens"),
    ("banaserve_instance_kv_capacity_tokens", "KV pool size in tokens", "kv_capacity_tokens"),
    ("banaserve_instance_gen_tokens_per_second", "Generation throughput", "gen_tokens_per_s"),
)  # fmt: skip
INSTANCE_COUNTERS = (
    ("banaserve_instance_routed_total", "Requests the gateway sent to the instance", "routed"),
    ("banaserve_instance_failed_total", "Requests to the instance that failed", "failed"),
    ("banaserve_instance_prompt_tokens_total", "Prompt tokens of finished requests",
     "prompt_tokens"),
    ("banaserve_instance_computed_prompt_tokens_total",
     "Prompt tokens the instance computed (not served from a cache)", "computed_prompt_tokens"),
)  # fmt: skip


#: (metric, help, key in the supervisor's report of a child: instances and the store)
CHILD_METRICS = (
    ("banaserve_instance_restarts_total", "Restarts of the child after it died", "restarts"),
    ("banaserve_instance_deaths_total", "Runs of the child that ended unasked", "deaths"),
    ("banaserve_instance_running", "1 if the child runs and serves (not dead or starting)",
     "running"),
)  # fmt: skip


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return "{" + inner + "}"


def render_metrics(state: dict[str, Any]) -> str:
    lines: list[str] = []
    instances = state["instances"]
    for metric, help_text, key in INSTANCE_GAUGES + INSTANCE_COUNTERS:
        kind = "counter" if metric.endswith("_total") else "gauge"
        lines += [f"# HELP {metric} {help_text}.", f"# TYPE {metric} {kind}"]
        for instance in instances:
            value = instance["load"][key] if key in instance["load"] else instance[key]
            labels = _labels(instance=instance["name"], role=instance["role"])
            lines.append(f"{metric}{labels} {float(value):g}")
    children = state.get("supervisor", {})
    for metric, help_text, key in CHILD_METRICS if children else ():
        kind = "counter" if metric.endswith("_total") else "gauge"
        lines += [f"# HELP {metric} {help_text}.", f"# TYPE {metric} {kind}"]
        for name, report in children.items():
            value = report["state"] == "running" if key == "running" else report[key]
            lines.append(f"{metric}{_labels(instance=name)} {float(value):g}")
    for key, value in state["gateway"].items():
        if key == "uptime_s":
            continue
        metric = f"banaserve_gateway_{key}_total"
        lines += [f"# HELP {metric} Gateway {key.replace('_', ' ')}.",
                  f"# TYPE {metric} counter", f"{metric} {value}"]  # fmt: skip
    if state.get("migration", {}).get("mode", "off") != "off":
        lines += migration_metrics(state["migration"])
    return "\n".join(lines) + "\n"
