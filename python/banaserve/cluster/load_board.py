"""The cluster's side of the router's board: the poller of every instance's ``/v1/loads``, and
the "instance gone" events that wake the requests waiting on an instance that left routing.

The accounting itself (load records, in-flight counts, when an instance leaves routing) is
:class:`banaserve.router.board.Board`, pure and shared with the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import aiohttp

from banaserve.cluster.topology import InstanceSpec
from banaserve.router.board import STALL_AFTER_S, Board
from banaserve.router.loads_report import LOADS_PATH

T = TypeVar("T")

POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 2.0
#: SGLang's ``/health_generate`` runs one token through the scheduler (it answers at once if
#: the scheduler produced output lately); it gives up on its own after 20 s.
PROBE_PATH = "/health_generate"
PROBE_TIMEOUT_S = 30.0


class InstanceGone(Exception):
    """The instance a request was waiting on left routing (died or stopped answering)."""


class LoadBoard(Board):
    """A :class:`Board` whose instances each have an :class:`asyncio.Event`, set when the
    instance leaves routing. Used from the gateway's event loop only, like the board."""

    def __init__(
        self, specs: Sequence[InstanceSpec], clock: Callable[[], float] = time.monotonic,
        stall_after_s: float = STALL_AFTER_S,
    ) -> None:  # fmt: skip
        super().__init__(specs, clock, stall_after_s)
        self._gone: dict[str, asyncio.Event] = {}

    def gone_event(self, url: str) -> asyncio.Event:
        """Set when ``url`` leaves routing, so requests waiting on it stop waiting."""
        event = self._gone.get(url)
        if event is None:
            event = self._gone[url] = asyncio.Event()
        return event

    async def race(self, awaitable: Awaitable[T], url: str) -> T:
        """Await ``awaitable`` unless ``url`` leaves routing first (then InstanceGone)."""
        gone = self.gone_event(url)
        task = asyncio.ensure_future(awaitable)
        if gone.is_set():
            task.cancel()
            raise InstanceGone(url)
        waiter = asyncio.ensure_future(gone.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task in done:
            return task.result()
        task.cancel()
        raise InstanceGone(f"{url} left routing")

    def _left(self, url: str) -> None:
        self.gone_event(url).set()

    def _returned(self, url: str) -> None:
        self._gone.pop(url, None)


async def poll_forever(board: Board, session: aiohttp.ClientSession) -> None:
    """Poll every instance's ``/v1/loads`` until cancelled; probe each stalled one (one
    probe at a time per instance, off the polling round) until a token gets through."""
    timeout = aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)
    probing: dict[str, asyncio.Task[None]] = {}

    async def probe(url: str) -> None:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            probe_timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            async with session.get(f"{url}{PROBE_PATH}", timeout=probe_timeout) as answer:
                if answer.status == 200:
                    board.unstalled(url)

    async def poll(spec: InstanceSpec) -> None:
        try:
            async with session.get(f"{spec.url}{LOADS_PATH}", timeout=timeout) as response:
                if response.status != 200:
                    board.record_poll(spec, None, f"{LOADS_PATH} answered {response.status}")
                    return
                answer = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            board.record_poll(spec, None, f"{LOADS_PATH} failed: {exc!r}")
            return
        board.record_poll(spec, answer)

    try:
        while True:
            await asyncio.gather(*(poll(spec) for spec in board.specs))
            for spec in board.specs:
                running = probing.get(spec.url)
                if board.is_stalled(spec.url) and (running is None or running.done()):
                    probing[spec.url] = asyncio.create_task(probe(spec.url))
            await asyncio.sleep(POLL_INTERVAL_S)
    finally:
        for task in probing.values():
            task.cancel()
