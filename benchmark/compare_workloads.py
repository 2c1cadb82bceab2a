"""The workloads of ``compare.py``: every one from ``sglang.bench_serving``, seeds fixed, so
each system gets the same prompts in the same order.

- ``hotspot``: one long shared system prompt takes every request;
- ``zipf``: 8 system prompts, popularity Zipf(1.1) (``--gsp-group-distribution zipf``);
- ``cache_pressure``: many long prefixes, more than one instance's KV pool holds, each
  reused later in shuffled order;
- ``uniform``: ``random-ids``, nothing shared;
- each also as ``…_long``: 128 output tokens instead of 4, where decoding dominates;
- ``chat``: multi-turn conversations over the chat API (``--gsp-num-turns``, backend
  ``sglang-oai-chat``): each turn's prompt is the whole conversation so far, so a turn finds
  the previous one cached only where its generated tokens were kept;
- ``decode_heavy``: nothing shared, 48 to 256 output tokens each, many at once;
- ``bursty``: zipf's prompts arriving at ``BURST_RATE`` req/s in on/off bursts
  (``bench_bursts.py``: the installed bench_serving has no burstiness flag);
- ``sweep_<rate>``: zipf's prompts at each of ``SWEEP_RATES`` (Poisson arrivals), for
  throughput and TTFT p99 against the offered rate.

Seeds differ per workload, so one workload's prompts never warm another's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

SHORT_OUT, LONG_OUT = 4, 128
#: ``chat``: turns per conversation and output tokens per turn (issue 30's multi-turn load).
CHAT_TURNS, CHAT_OUT = 4, 24
#: ``decode_heavy``: output tokens drawn from [DECODE_HEAVY_MIN, DECODE_HEAVY_OUT].
DECODE_HEAVY_MIN, DECODE_HEAVY_OUT = 48, 256
ZIPF_GROUPS, ZIPF_ALPHA = 8, 1.1
BURST_RATE, BURST_ON_S, BURST_OFF_S = 4.0, 6.0, 12.0
#: Offered rates in req/s, from below to above the 2-core saturation point (rate-bound, not
#: scale-bound: ``--scale`` changes how many prompts, not their cost). At 0.1 to 0.8 req/s
#: both BanaServe and the best baseline kept up, throughput equal to the offered rate
#: (RESULTS.md, session 13); zipf with every request at once saturates them at 0.4 to 0.75.
SWEEP_RATES = (0.2, 0.4, 0.8, 1.6)


@dataclass(frozen=True)
class Workload:
    name: str
    dataset_args: tuple[str, ...]
    num_prompts: int
    max_concurrency: int
    seed: int
    #: Poisson arrivals at this many requests/s; None: as fast as ``max_concurrency`` allows.
    request_rate: float | None = None
    #: (on, off) seconds of a burst schedule at ``request_rate``.
    bursts: tuple[float, float] | None = None
    #: ``bench_serving``'s backend: ``sglang`` (``/generate``), or ``sglang-oai-chat`` for
    #: multi-turn conversations, which only its chat backends replay.
    backend: str = "sglang"


def shared_prefix_args(
    groups: int, per_group: int, prefix_len: int, out: int, zipf: bool = False
) -> tuple[str, ...]:
    """``generated-shared-prefix``: ``groups`` system prompts, shuffled requests."""
    args = ("--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups),
            "--gsp-prompts-per-group", str(per_group), "--gsp-system-prompt-len",
            str(prefix_len), "--gsp-question-len", "32", "--gsp-output-len", str(out))  # fmt: skip
    if zipf:
        args += ("--gsp-group-distribution", "zipf", "--gsp-zipf-alpha", str(ZIPF_ALPHA))
    return args


def chat_args(groups: int, per_group: int, prefix_len: int) -> tuple[str, ...]:
    """``groups`` system prompts, ``per_group`` conversations each of ``CHAT_TURNS`` turns."""
    return (*shared_prefix_args(groups, per_group, prefix_len, CHAT_OUT),
            "--gsp-num-turns", str(CHAT_TURNS))  # fmt: skip


def uniform_args(prompt_len: int, out: int, range_ratio: float = 1.0) -> tuple[str, ...]:
    """``random-ids``: lengths drawn from [``range_ratio`` x, x] (1.0: exactly x)."""
    return ("--dataset-name", "random-ids", "--random-input-len", str(prompt_len),
            "--random-output-len", str(out),
            "--random-range-ratio", f"{range_ratio:g}")  # fmt: skip


def scaled(n: int, scale: float, multiple: int = 1) -> int:
    """``n`` times ``scale``, a multiple of ``multiple``, at least ``multiple`` (and 2)."""
    return max(multiple, 2, round(n * scale / multiple) * multiple)


def workloads(quick: bool, scale: float = 1.0) -> list[Workload]:
    """Every workload; ``quick``: shorter prompts and fewer of them; ``scale`` multiplies the
    number of prompts of each."""
    scale *= 1 / 3 if quick else 1.0
    prefix = 512 if quick else 1024
    hot, long_ = scaled(96, scale), scaled(48, scale)
    pressure_groups = 16 if quick else 48
    # Each prefix used twice at least, whatever the scale: a first use fills, a second reuses.
    pressure = max(2 * pressure_groups, scaled(96, scale, pressure_groups))
    zipf, zipf_long = scaled(96, scale, ZIPF_GROUPS), scaled(48, scale, ZIPF_GROUPS)
    uniform, uniform_long = scaled(48, scale), scaled(32, scale)
    chats, decode_heavy = scaled(36, scale, ZIPF_GROUPS // 2), scaled(48, scale)
    # Two bursts at least, whatever the scale.
    bursty = max(scaled(96, scale, ZIPF_GROUPS), 2 * round(BURST_RATE * BURST_ON_S))

    def gsp(groups: int, n: int, out: int, zipf: bool = False) -> tuple[str, ...]:
        return shared_prefix_args(groups, n // groups, prefix, out, zipf)

    def conc(c: int) -> int:
        # Scaled with the prompts, so the shape stays: with 24 prompts at 32 concurrent every
        # request of a hotspot would arrive at once, before any could find the prefix cached.
        return max(2, round(c * scale))

    out = [
        Workload("hotspot", gsp(1, hot, SHORT_OUT), hot, conc(32), seed=1),
        Workload("hotspot_long", gsp(1, long_, LONG_OUT), long_, conc(16), seed=11),
        Workload("zipf", gsp(ZIPF_GROUPS, zipf, SHORT_OUT, True), zipf, conc(32), seed=4),
        Workload(
            "zipf_long", gsp(ZIPF_GROUPS, zipf_long, LONG_OUT, True), zipf_long, conc(16), seed=14
        ),  # fmt: skip
        Workload("cache_pressure", gsp(pressure_groups, pressure, SHORT_OUT), pressure, 8, seed=2),
        Workload(
            "cache_pressure_long",
            gsp(pressure_groups // 2, pressure // 2, LONG_OUT),
            pressure // 2,
            8,
            seed=12,
        ),  # fmt: skip
        Workload("uniform", uniform_args(prefix, SHORT_OUT), uniform, conc(16), seed=3),
        Workload("uniform_long", uniform_args(prefix, LONG_OUT), uniform_long, conc(16), seed=13),
        Workload(
            "chat",
            chat_args(ZIPF_GROUPS // 2, chats // (ZIPF_GROUPS // 2), prefix),
            chats,
            conc(12),
            seed=15,
            backend="sglang-oai-chat",
        ),  # fmt: skip
        Workload(
            "decode_heavy",
            uniform_args(prefix // 2, DECODE_HEAVY_OUT, DECODE_HEAVY_MIN / DECODE_HEAVY_OUT),
            decode_heavy,
            conc(32),
            seed=16,
        ),  # fmt: skip
        Workload(
            "bursty",
            gsp(ZIPF_GROUPS, bursty, SHORT_OUT, True),
            bursty,
            64,
            seed=5,
            request_rate=BURST_RATE,
            bursts=(BURST_ON_S, BURST_OFF_S),
        ),  # fmt: skip
    ]
    return out


def sweep_workloads(quick: bool, scale: float = 1.0) -> list[Workload]:
    """zipf's prompts at each rate of ``SWEEP_RATES`` (one seed: the same prompts each)."""
    zipf = next(w for w in workloads(quick, scale) if w.name == "zipf")
    return [
        Workload(
            f"sweep_{rate:g}", zipf.dataset_args, zipf.num_prompts, 64, seed=6, request_rate=rate
        )  # fmt: skip
        for rate in SWEEP_RATES
    ]
