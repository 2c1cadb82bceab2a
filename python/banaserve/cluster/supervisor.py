"""Supervision: every child of the cluster that dies is reported and started again.

:meth:`Supervisor.run` looks at every child each :data:`MONITOR_INTERVAL_S`. A child that
exited is reported once with the last lines of its log, an instance leaves routing, and a
restart is scheduled by :class:`~banaserve.config.restart_policy.RestartPolicy`
(exponential backoff, a cap per minute). The new run logs to the same file; once it answers
(``/health`` for an instance, its port for the store) an instance is back in routing.

Each death is a :class:`Death`. Whether the child *crashed by itself* matters to the gateway's
poison-pill guard (:mod:`banaserve.cluster.poison`): an SGLang server whose scheduler raised
kills its own process tree with SIGKILL, so its exit status looks like a kill from outside;
what tells them apart is what SGLang logs first (:data:`SGLANG_CRASH_MARKERS`).

Everything runs on the gateway's event loop, in the main thread: children are started by the
thread that lives as long as the launcher, which their PDEATHSIG is tied to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from banaserve.cluster.leftovers import LeftoverLedger
from banaserve.cluster.load_board import LoadBoard
from banaserve.cluster.processes import START_TIMEOUT_S, Child, ClusterProcesses
from banaserve.cluster.topology import InstanceSpec
from banaserve.config.restart_policy import RestartPolicy
from banaserve.utils.processes import tail

logger = logging.getLogger("banaserve.cluster")

MONITOR_INTERVAL_S = 1.0
#: How often the children's shm mappings are recorded, for the clean-ups after a death and at
#: exit.
LEDGER_SCAN_EVERY_S = 5.0
#: Lines SGLang logs when one of an instance's own processes failed (then it SIGKILLs itself).
SGLANG_CRASH_MARKERS = (
    "Scheduler hit an exception",
    "DetokenizerManager hit an exception",
    "It usually means one child failed",
)
DEATHS_KEPT = 16

ReadyCheck = Callable[[Child], Awaitable[bool]]
#: Called with an instance's spec when it restarts as a different one (a two-stage instance
#: coming back whole: :meth:`ClusterProcesses.respawn`).
Respecced = Callable[[InstanceSpec], None]


@dataclass(frozen=True)
class Death:
    """One run of a child that ended without the cluster stopping it."""

    name: str
    pid: int
    returncode: int | None
    at: float  # monotonic
    crashed_by_itself: bool

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "returncode": self.returncode,
                "crashed_by_itself": self.crashed_by_itself}  # fmt: skip


def crashed_by_itself(returncode: int | None, log: str) -> bool:
    """An exit status > 0 (an error raised in the server) or SGLang's crash lines in the
    run's log; a signal with neither came from outside (OOM killer, an operator)."""
    return (returncode or 0) > 0 or any(marker in log for marker in SGLANG_CRASH_MARKERS)


@dataclass
class ChildState:
    """The supervisor's view of one child (touched on the event loop only)."""

    phase: str = "running"  # running | waiting (to restart) | starting
    restarts: list[float] = field(default_factory=list)  # start times of restarts
    deaths: deque[Death] = field(default_factory=lambda: deque(maxlen=DEATHS_KEPT))  # newest
    deaths_total: int = 0
    restart_at: float | None = None
    back: asyncio.Event = field(default_factory=asyncio.Event)

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "state": self.phase,
            "restarts": len(self.restarts),
            "deaths": self.deaths_total,
            "last_death": self.deaths[-1].to_json() if self.deaths else None,
            "restart_in_s": None if self.restart_at is None
            else round(max(0.0, self.restart_at - now), 1),
        }  # fmt: skip


class Supervisor:
    """Watches and restarts ``processes``' children; instance health goes to ``board``.

    ``ready`` answers whether a restarted child serves yet (one probe; it must not block).
    Owns the restart tasks; :meth:`run` is cancelled to stop supervising (the children are
    stopped by :meth:`ClusterProcesses.stop`).
    """

    def __init__(
        self,
        processes: ClusterProcesses,
        board: LoadBoard,
        ready: ReadyCheck,
        policy: RestartPolicy | None = None,
        ledger: LeftoverLedger | None = None,
        clock: Callable[[], float] = time.monotonic,
        start_timeout_s: float = START_TIMEOUT_S,
        on_respecced: Respecced | None = None,
    ) -> None:
        self.processes = processes
        self.board = board
        self.ready = ready
        self.policy = policy or RestartPolicy()
        self.ledger = ledger
        self.clock = clock
        self.start_timeout_s = start_timeout_s
        self.on_respecced = on_respecced
        self.states = {child.name: ChildState() for child in processes.children}
        for state in self.states.values():
            state.back.set()
        self._by_url = {child.url: child for child in processes.instances}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        next_scan = 0.0
        try:
            while True:
                self.check()
                now = self.clock()
                if self.ledger is not None and now >= next_scan:
                    next_scan = now + LEDGER_SCAN_EVERY_S
                    await asyncio.to_thread(self.ledger.scan)
                await asyncio.sleep(MONITOR_INTERVAL_S)
        finally:
            for task in self._tasks:
                task.cancel()

    def check(self) -> None:
        """Record the children that died and start those whose restart is due."""
        if self.processes.stopped:
            return
        now = self.clock()
        for child in self.processes.children:
            state = self.states[child.name]
            if state.phase != "waiting" and not child.process.alive():
                self._died(child, state, now)
            if (
                state.phase == "waiting"
                and state.restart_at is not None
                and now >= state.restart_at
            ):
                self._restart(child, state, now)

    def _died(self, child: Child, state: ChildState, now: float) -> Death:
        process = child.process
        code = process.process.returncode
        death = Death(child.name, process.pid, code, now,
                      crashed_by_itself(code, process.log_since_start(256 << 10)))  # fmt: skip
        state.deaths.append(death)
        state.deaths_total += 1
        state.back.clear()
        if child.url is not None:
            self.board.mark_dead(child.url)
        if self.ledger is not None:
            # Before the restart: what the dead run left in /dev/shm goes with it.
            _, removed = self.ledger.release(process.pid)
            if removed:
                logger.info("removed %d shared-memory files %s left", removed, child.name)
        state.phase = "waiting"
        state.restart_at = self.policy.restart_at(state.restarts, now)
        cause = "crashed" if death.crashed_by_itself else "was killed"
        logger.error(
            "%s (pid %d) exited with code %s (%s); last lines of %s:\n%s\n"
            "restarting it in %.0f s (%d restarts so far)",
            child.name, process.pid, code, cause, process.log_path,
            tail(process.log_path, 20), state.restart_at - now, len(state.restarts),
        )  # fmt: skip
        return death

    def _restart(self, child: Child, state: ChildState, now: float) -> None:
        spec = child.spec
        child.process = self.processes.respawn(child)
        if child.spec is not None and child.spec is not spec:
            self.board.replace_spec(child.spec)
            if self.on_respecced is not None:
                self.on_respecced(child.spec)
        state.restarts.append(now)
        state.phase = "starting"
        state.restart_at = None
        if self.ledger is not None:
            self.ledger.add_session(child.process.pid)
        logger.info("restarting %s (pid %d, restart %d)", child.name, child.process.pid,
                    len(state.restarts))  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._until_ready(child, state))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _until_ready(self, child: Child, state: ChildState) -> None:
        process = child.process
        deadline = self.clock() + self.start_timeout_s
        while process.alive() and child.process is process:
            with contextlib.suppress(Exception):
                if await self.ready(child):
                    if self.ledger is not None:
                        # A run makes its last shm files just before it is ready (measured:
                        # a semaphore ~4 s before); a kill before the next periodic scan
                        # would leave them unattributed.
                        await asyncio.to_thread(self.ledger.scan)
                    state.phase = "running"
                    if child.url is not None:
                        self.board.revive(child.url)
                    state.back.set()
                    logger.info("%s is back (pid %d) after %.0f s", child.name, process.pid,
                                self.clock() - state.restarts[-1])  # fmt: skip
                    return
            if self.clock() > deadline:
                logger.error("%s not ready %.0f s after its restart: stopping it",
                             child.name, self.start_timeout_s)  # fmt: skip
                await asyncio.to_thread(process.stop)  # the next check() schedules another
                return
            await asyncio.sleep(0.5)

    # -- what the gateway asks -----------------------------------------------------------------

    def pid_of(self, url: str) -> int:
        return self._by_url[url].process.pid

    async def death_of(self, url: str, pid: int, wait_s: float) -> Death | None:
        """The death of run ``pid`` of the instance at ``url`` if it ends within ``wait_s``
        (a request to it just failed: did the instance die, or only the connection?)."""
        child = self._by_url[url]
        state = self.states[child.name]
        deadline = self.clock() + wait_s
        while True:
            for death in state.deaths:
                if death.pid == pid:
                    return death
            if child.process.pid == pid and not child.process.alive():
                if state.phase != "waiting":
                    return self._died(child, state, self.clock())
            if child.process.pid != pid and not any(d.pid == pid for d in state.deaths):
                return None  # an earlier run, whose end was not seen as a death
            if self.clock() >= deadline:
                return None
            await asyncio.sleep(0.05)

    async def wait_back(self, url: str, timeout_s: float) -> bool:
        """Wait until the instance at ``url`` has been restarted and serves again."""
        state = self.states[self._by_url[url].name]
        try:
            await asyncio.wait_for(state.back.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def report(self) -> dict[str, dict[str, Any]]:
        """Per child: state, restarts, deaths, the last death (for /cluster and /metrics)."""
        now = self.clock()
        return {name: state.to_json(now) for name, state in self.states.items()}
