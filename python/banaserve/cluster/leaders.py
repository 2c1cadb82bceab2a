"""The prompts other requests wait for: a handoff's in its prefill step, a leading direct
request's until its first token (:class:`~banaserve.router.placement.Placement` ``leads``).

A request that *follows* one (``Placement.follows``) is held at the gateway until that prompt
is computed, then loads it from the store instead of computing it again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from banaserve.router.request_shape import RequestShape
from banaserve.router.router import Router

#: The longest a direct request waits for the prompt it follows.
FOLLOW_WAIT_S = 30.0


class Leaders:
    """An event per prompt being computed, set when it is.

    Contract: confined to the gateway's event loop (nothing is locked). Every :meth:`begin`
    returns an ``end`` callable that the caller must call at least once (later calls do
    nothing); it tells the router's placer the prompt is computed and releases the followers.
    Only :meth:`wait` blocks, for at most ``timeout_s``.
    """

    def __init__(self, router: Router) -> None:
        self.router = router
        self._events: dict[str, asyncio.Event] = {}

    def begin(self, shape: RequestShape) -> Callable[[], None]:
        """``shape``'s prompt is being computed from now on; the callable ends that. Call it
        right after the placement, before any ``await``, so that a request placed meanwhile
        finds the prompt to follow."""
        event = self._events.setdefault(shape.prompt, asyncio.Event())
        ended = False

        def end() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            self.router.prefilled(shape)
            event.set()
            if self._events.get(shape.prompt) is event:
                del self._events[shape.prompt]

        return end

    def computing(self, prompt: str | None) -> asyncio.Event | None:
        """The event set once ``prompt`` is computed; None when it is not being computed
        (nothing to follow)."""
        return self._events.get(prompt or "")

    @staticmethod
    async def wait(event: asyncio.Event, timeout_s: float = FOLLOW_WAIT_S) -> None:
        """Wait until ``event`` (of :meth:`computing`) is set, for at most ``timeout_s``."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
