"""After a request to an instance failed: did the instance die, and where does it go next.

The gateway calls :meth:`Failover.after_failure` for every failed attempt. A request that
never reached the instance (connection refused), or whose instance lives on (a broken
connection, a poll time-out), goes elsewhere as before. One whose instance died while
serving it is counted against its body by the :class:`~banaserve.cluster.poison.PoisonGuard`,
which says whether it is retried once (on the same instance once restarted, or elsewhere) or
answered 500 and quarantined.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from banaserve.cluster.http_errors import error_response, unavailable
from banaserve.cluster.intake import Admitted
from banaserve.cluster.load_board import LoadBoard
from banaserve.cluster.poison import PoisonGuard, Retry
from banaserve.cluster.supervisor import Death

logger = logging.getLogger("banaserve.cluster")

#: How long the gateway waits to see whether an instance whose connection broke has died.
DEATH_WAIT_S = 3.0
#: How long a request waits for the restart of the instance that crashed serving it.
RESTART_WAIT_S = 300.0


class InstanceDeaths(Protocol):
    """What the gateway asks the supervisor (:class:`~banaserve.cluster.supervisor.
    Supervisor`) about an instance whose request failed. Called on the gateway's loop."""

    def pid_of(self, url: str) -> int:
        """The PID of the instance's current run."""

    async def death_of(self, url: str, pid: int, wait_s: float) -> Death | None:
        """The death of run ``pid``, if it ends within ``wait_s``; None if it lives."""

    async def wait_back(self, url: str, timeout_s: float) -> bool:
        """Wait for the instance to be restarted and serve again; False on time-out."""

    def report(self) -> dict[str, dict[str, Any]]:
        """Per child: its state, restarts and deaths (for /cluster and /metrics)."""


class InstanceDied(Exception):
    """An instance answered an error (5xx) and died: SGLang may fail the requests of a
    crashed scheduler before its server goes down. Handled like a broken connection."""

    def __init__(self, death: Death) -> None:
        super().__init__(f"{death.name} died serving the request")
        self.death = death


class FailoverCounters(Protocol):
    retries: int
    deaths_while_serving: int
    quarantined: int


class Failover:
    """The gateway's failure handling; used on its event loop (no lock). Without ``deaths``
    (no supervisor: unit tests) every failure is a plain retry elsewhere.

    Owns nothing but the poison guard; the board and the counters are the gateway's. Its
    coroutines block their request (never the loop) while the supervisor settles a death:
    at most ``DEATH_WAIT_S`` to learn whether an instance died, ``RESTART_WAIT_S`` for it to
    come back.
    """

    def __init__(
        self,
        board: LoadBoard,
        counters: FailoverCounters,
        deaths: InstanceDeaths | None = None,
        guard: PoisonGuard | None = None,
    ) -> None:
        self.board = board
        self.counters = counters
        self.deaths = deaths
        self.guard = guard if guard is not None else PoisonGuard()

    def pid_of(self, url: str) -> int | None:
        """The run of ``url`` a request is about to be sent to."""
        return self.deaths.pid_of(url) if self.deaths is not None else None

    async def raise_if_died(self, url: str, pid: int | None, status: int) -> None:
        """After a 5xx from ``url``: raise :class:`InstanceDied` if the instance died."""
        if status >= 500 and self.deaths is not None and pid is not None:
            death = await self.deaths.death_of(url, pid, DEATH_WAIT_S)
            if death is not None:
                raise InstanceDied(death)

    async def after_failure(
        self, url: str, pid: int | None, exc: BaseException, admitted: Admitted, step: str
    ) -> tuple[Retry, web.Response | None]:
        """What to do after a request to ``url`` (run ``pid``) failed with ``exc``: where to
        retry it, or the response to give (a 500 once it has killed two instances). A
        failed ``"stream"`` step is past retrying: only a death is counted."""
        self.counters.retries += step != "stream"
        death = exc.death if isinstance(exc, InstanceDied) else None
        if death is None and not isinstance(exc, aiohttp.ClientConnectorError) and self.deaths:
            assert pid is not None  # the request reached the instance: did that kill it?
            death = await self.deaths.death_of(url, pid, DEATH_WAIT_S)
        self.board.mark_failed(url, f"{step} request failed: {exc!r}")
        if death is None:
            return Retry.ELSEWHERE, None
        self.counters.deaths_while_serving += 1
        verdict = self.guard.after_death(admitted.digest, death.crashed_by_itself)
        if verdict is not Retry.QUARANTINE:
            logger.warning(
                "%s died serving request %s (digest %s, %s): retrying it %s", death.name,
                request_id(admitted), admitted.digest, step,
                "once restarted" if verdict is Retry.SAME_INSTANCE else "elsewhere",
            )  # fmt: skip
            return verdict, None
        self.counters.quarantined += 1
        message = (
            f"An instance died serving this request for the second time ({death.name}); it is "
            f"not retried again, and identical requests are refused for "
            f"{self.guard.quarantine_s:.0f} s (request {request_id(admitted)}, digest "
            f"{admitted.digest})."
        )
        logger.error("%s", message)
        return verdict, error_response(500, message, "InternalServerError")

    async def next_try(
        self, url: str, pid: int | None, exc: BaseException, admitted: Admitted, step: str
    ) -> tuple[web.Response | None, str | None]:
        """After a failed attempt: the response to give the client, or None and the one
        instance to try next (None: any other), waiting for its restart if it must."""
        verdict, refused = await self.after_failure(url, pid, exc, admitted, step)
        if refused is None and verdict is Retry.SAME_INSTANCE:
            refused = await self.wait_restart(url)
            return refused, url
        return refused, None

    async def wait_restart(self, url: str) -> web.Response | None:
        """Wait for ``url``'s restart; the 503 to answer if it does not come back in time."""
        assert self.deaths is not None
        if await self.deaths.wait_back(url, RESTART_WAIT_S):
            return None
        return unavailable(f"The instance serving this request ({url}) died and did not "
                           f"come back within {RESTART_WAIT_S:.0f} s.")  # fmt: skip


def request_id(admitted: Admitted) -> str:
    """The client's ``rid`` when it gave one, else the digest's head."""
    rid = admitted.body.get("rid")
    return rid if isinstance(rid, str) and len(rid) <= 128 else f"d-{admitted.digest[:8]}"
