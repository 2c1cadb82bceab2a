"""The phase-shifting load of ``migration_bench.py``, and what it measures per request.

A run is ``cycles`` repetitions of three phases: prefill-heavy (long prompts, few output
tokens), decode-heavy (short prompts, long outputs), prefill-heavy again. Each phase sends its
requests with Poisson arrivals at its rate; every prompt is fresh token ids (so nothing is
cached across requests or systems: each phase's shape is what it says), the same ids for every
system (one seed). Requests stream from ``/generate`` with ``ignore_eos``, so each produces
exactly its output tokens; the client takes each one's TTFT and TPOT from the stream.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp


@dataclass(frozen=True)
class Phase:
    name: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    rate: float  # requests per second, Poisson


@dataclass(frozen=True)
class Slo:
    """A request is good when its first token and its time per output token meet these."""

    ttft_s: float
    tpot_s: float


def phases(quick: bool = False, cycles: int = 2) -> list[Phase]:
    """The schedule: prefill-heavy, decode-heavy, prefill-heavy, ``cycles`` times. Sized for
    SmolLM2-135M fp32 on two CPU cores (``quick``: a few requests, for a smoke run)."""
    scale = 0.25 if quick else 1.0
    prefill = Phase("prefill_heavy", max(2, round(16 * scale)), 1024, 4, 0.5)
    decode = Phase("decode_heavy", max(2, round(12 * scale)), 32, 128, 0.3)
    return [phase for _ in range(cycles) for phase in (prefill, decode, prefill)]


@dataclass(frozen=True)
class Request:
    phase: str
    send_at: float  # seconds after the run's start
    input_ids: list[int]
    output_tokens: int


def schedule(plan: Sequence[Phase], vocab: int, seed: int = 7) -> list[Request]:
    """Every request of ``plan`` with its send time; phases follow each other as their
    arrivals end. Token ids avoid the first 100 ids (special tokens in most vocabularies)."""
    rng = random.Random(seed)
    out, at = [], 0.0
    for phase in plan:
        for _ in range(phase.requests):
            at += rng.expovariate(phase.rate)
            ids = [rng.randrange(100, vocab) for _ in range(phase.prompt_tokens)]
            out.append(Request(phase.name, at, ids, phase.output_tokens))
    return out


@dataclass
class Outcome:
    phase: str
    sent_at: float
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float:
        steps = self.output_tokens - 1
        return (self.e2e_s - self.ttft_s) / steps if steps > 0 else 0.0

    def good(self, slo: Slo) -> bool:
        return not self.error and self.ttft_s <= slo.ttft_s and self.tpot_s <= slo.tpot_s


async def send(session: aiohttp.ClientSession, url: str, request: Request, start: float) -> Outcome:
    """One streamed ``/generate``; its times from the client's side."""
    await asyncio.sleep(max(0.0, start + request.send_at - time.perf_counter()))
    sent = time.perf_counter()
    outcome = Outcome(request.phase, sent - start)
    body = {"input_ids": request.input_ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": request.output_tokens,
                                "ignore_eos": True}}  # fmt: skip
    try:
        async with session.post(f"{url}/generate", json=body) as response:
            if response.status != 200:
                outcome.error = f"{response.status}: {(await response.text())[:200]}"
                return outcome
            async for line in response.content:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if not outcome.ttft_s:
                    outcome.ttft_s = time.perf_counter() - sent
                outcome.output_tokens = int(chunk["meta_info"]["completion_tokens"])
        outcome.e2e_s = time.perf_counter() - sent
    except (aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
        outcome.error = repr(exc)
    return outcome


async def drive(url: str, requests: Sequence[Request]) -> tuple[list[Outcome], float]:
    """Send every request on its schedule; the outcomes and the run's wall seconds."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(send(s, url, r, start) for r in requests))
        return list(outcomes), time.perf_counter() - start


@dataclass
class Summary:
    """One run of one system."""

    requests: int
    failed: int
    duration_s: float
    throughput: float  # requests per second
    goodput: float  # requests meeting the SLO, per second
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    moves: int = 0
    bytes_moved: int = 0
    by_phase: dict[str, float] = field(default_factory=dict)  # goodput share per phase


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarise(outcomes: Sequence[Outcome], duration_s: float, slo: Slo) -> Summary:
    done = [o for o in outcomes if not o.error]
    ttft = [o.ttft_s for o in done]
    tpot = [o.tpot_s for o in done if o.output_tokens > 1]
    by_phase: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_phase.setdefault(outcome.phase, []).append(outcome)
    return Summary(
        len(outcomes), len(outcomes) - len(done), duration_s,
        len(done) / duration_s if duration_s else 0.0,
        sum(o.good(slo) for o in outcomes) / duration_s if duration_s else 0.0,
        percentile(ttft, 0.5), percentile(ttft, 0.99), percentile(tpot, 0.5),
        percentile(tpot, 0.99),
        by_phase={name: statistics.fmean(o.good(slo) for o in group)
                  for name, group in by_phase.items()},
    )  # fmt: skip
