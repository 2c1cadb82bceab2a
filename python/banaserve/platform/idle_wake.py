"""Requests waiting for KV from the store are not held back by ``--sleep-on-idle``.

BanaServe adds ``--sleep-on-idle`` on the CPU so that an idle scheduler does not spin a core
(several instances share two cores here). With it, a scheduler pass that runs no batch polls
the scheduler's input sockets for up to one second (``IdleSleeper.maybe_sleep``). A pass whose
waiting requests cannot run yet, because their prefix is still coming from the KV store on
HiCache's prefetch thread, counts as idle too, and nothing wakes the poll when the pages land:
HiCache needs several passes to admit a prefetched request, so each pass cost up to a second
(measured: 24 to 64 s before a burst's first batch on an instance with nothing else to do).

Applied by the import hook right after ``sglang.srt.managers.scheduler`` executes, on the CPU
platform only (where BanaServe turns sleeping on): with requests in the waiting queue the poll
lasts :data:`WAITING_POLL_MS`; a scheduler with nothing waiting sleeps as before.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

#: How long an otherwise idle pass polls while requests wait: short enough that a prefetched
#: request is admitted within milliseconds, long enough that the wait costs no CPU to speak of.
WAITING_POLL_MS = 5


def wake_for_waiting(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``Scheduler.maybe_sleep_on_idle`` that polls briefly while requests wait."""

    def maybe_sleep_on_idle(self: Any) -> None:
        poller = getattr(self.idle_sleeper, "poller", None)
        if poller is not None and len(self.waiting_queue) > 0:
            poller.poll(WAITING_POLL_MS)
            return
        original(self)

    maybe_sleep_on_idle.__wrapped__ = original  # type: ignore[attr-defined]
    return maybe_sleep_on_idle


def patch_scheduler(module: types.ModuleType) -> None:
    scheduler = getattr(module, "Scheduler", None)
    original = getattr(scheduler, "maybe_sleep_on_idle", None)
    if original is None or hasattr(original, "__wrapped__"):
        return  # another SGLang layout, or patched already
    scheduler.maybe_sleep_on_idle = wake_for_waiting(original)  # type: ignore[union-attr]


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.managers.scheduler": patch_scheduler,
}
