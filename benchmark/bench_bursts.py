"""``sglang.bench_serving`` with on/off bursts: ``python benchmark/bench_bursts.py --on-s ON
--off-s OFF [bench_serving flags…]``.

The installed ``bench_serving`` sends Poisson arrivals at ``--request-rate`` (or all at once)
and has no burstiness flag. This runs its own command line unchanged, with its arrival
generator (``get_request``) wrapped: requests come at ``--request-rate`` for ``ON`` seconds,
then none for ``OFF`` seconds, and again, until every prompt was sent. What it measures and
writes (``--output-file``) is bench_serving's own.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any


def off_until(start: float, now: float, on_s: float, off_s: float) -> float:
    """0 inside an on period of the schedule that began at ``start``; otherwise the seconds
    until the next on period begins."""
    into = (now - start) % (on_s + off_s)
    return 0.0 if into < on_s else on_s + off_s - into


def bursty(
    get_request: Callable[..., AsyncIterator[Any]], on_s: float, off_s: float
) -> Callable[..., AsyncIterator[Any]]:
    async def schedule(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        start = time.perf_counter()
        async for request in get_request(*args, **kwargs):
            wait = off_until(start, time.perf_counter(), on_s, off_s)
            if wait:
                await asyncio.sleep(wait)
            yield request

    return schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--on-s", type=float, required=True)
    parser.add_argument("--off-s", type=float, required=True)
    ours, rest = parser.parse_known_args()
    if ours.on_s <= 0 or ours.off_s < 0:
        parser.error("--on-s must be positive and --off-s not negative")
    from sglang.benchmark import serving

    serving.get_request = bursty(serving.get_request, ours.on_s, ours.off_s)
    sys.argv = [sys.argv[0], *rest]
    serving.cli_main()


if __name__ == "__main__":
    main()
