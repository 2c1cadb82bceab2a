"""``--migration role`` in the gateway: the role controller runs every :data:`TICK_S` over the
board's records and its moves relabel instances on the board; ``GET /migration`` reports the
state and history, ``POST /migration`` is the admin's (turn the controller off or on, move an
instance by hand).

``POST /migration`` takes a JSON object with either or both of:

- ``"controller": "on" | "off"``: whether the controller moves instances;
- ``"instance": NAME, "role": "prefill" | "decode" | "mixed"``: move that instance now (it
  then dwells in that role like a controller move). Refused with 409 when it would leave
  prefill steps or serve steps without a healthy instance to take them;
- ``"reset": true``: every instance back in the role it was started in, and the controller's
  memory (smoothed demand, dwell times) forgotten, as between two benchmark runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from banaserve.cluster.migration_loop import HISTORY, TICK_S, MigrationRefused, admin_call
from banaserve.migration.role_controller import (
    ROLES,
    TAKES,
    WORK,
    RoleController,
    RoleControllerConfig,
    RoleMove,
)
from banaserve.router.base import Role
from banaserve.router.board import Board, Member

logger = logging.getLogger("banaserve.cluster")


class RoleMigration:
    """The controller's loop and the admin API of one cluster.

    Owns the controller and the history; the board is the gateway's. Confined to the gateway's
    event loop (as the board is): nothing is locked, and nothing blocks but the sleep between
    ticks.
    """

    def __init__(
        self, board: Board, controller: RoleController, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.board = board
        self.controller = controller
        self.clock = clock
        self.enabled = True
        self.history: deque[RoleMove] = deque(maxlen=HISTORY)
        self.moves = 0
        self.bytes_moved = 0
        self._by_name: dict[str, Member] = {spec.name: spec for spec in board.specs}

    @classmethod
    def for_board(cls, board: Board, config: RoleControllerConfig | None = None) -> RoleMigration:
        """A controller with ``config`` (default: the defaults) over ``board``'s instances,
        knowing their cores (specs with ``cores``) and the roles they were started in."""
        cores = {s.url: tuple(s.cores) for s in board.specs if getattr(s, "cores", ())}
        home = {spec.url: Role(spec.role) for spec in board.specs}
        return cls(board, RoleController(config or RoleControllerConfig(), cores=cores, home=home))

    def arrived(self, prompt_tokens: int, output_tokens: int) -> None:
        """The role controller reads no arrival trend."""

    def records(self) -> list[Any]:
        return [load for role in ROLES for load in self.board.candidates(role)]

    def tick(self) -> list[RoleMove]:
        """One controller step, its moves applied (none while the controller is off)."""
        if not self.enabled:
            return []
        moves = self.controller.step(self.records(), self.clock())
        for move in moves:
            self._apply(move)
        return moves

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick()
            except Exception:  # a controller bug must not stop serving
                logger.exception("migration controller step failed")

    def move(self, name: str, role: str) -> RoleMove:
        """Move instance ``name`` to ``role`` now, by hand."""
        spec = self._by_name.get(name)
        if spec is None:
            known = sorted(self._by_name)
            raise MigrationRefused(f"no instance named {name!r}; instances: {known}")
        choices = "', '".join(ROLES)
        try:
            target = Role(role)
        except ValueError:
            raise MigrationRefused(f"'role' must be one of '{choices}', got {role!r}") from None
        source = self.board.role_of(spec.url)
        if source == target:
            raise MigrationRefused(f"{name} already serves as {target}", status=409)
        now, roles = self.clock(), self._roles()
        after = {**roles, spec.url: target} if spec.url in roles else roles
        for work in WORK:
            if not any(r in TAKES[work] for r in after.values()):
                message = f"moving {name} to {target} would leave no healthy instance for {work}"
                raise MigrationRefused(message, status=409)
        before = max(self.controller.utilisation(roles).values())
        predicted = max(self.controller.utilisation(after).values())
        move = RoleMove(spec.url, source, target, now, before, predicted, reason="admin")
        self.controller.moved(spec.url, now)
        self._apply(move)
        return move

    def reset(self) -> None:
        """Every instance back in its home role; the controller starts afresh."""
        for spec in self.board.specs:
            if self.board.role_of(spec.url) != spec.role:
                self.board.set_role(spec.url, Role(spec.role))
        self.controller.forget()
        logger.info("migration: every instance back in its home role")

    def _roles(self) -> dict[str, Role]:
        """The current role of every healthy instance."""
        return {c.url: Role(c.role) for c in self.records() if c.healthy}

    def _apply(self, move: RoleMove) -> None:
        self.board.set_role(move.url, move.to_role)
        self.history.append(move)
        self.moves += 1
        self.bytes_moved += move.bytes_moved
        name = next((s.name for s in self.board.specs if s.url == move.url), move.url)
        logger.info(
            "migration: %s now serves as %s (%s; peak utilisation %.2f -> %.2f)",
            name, move.to_role, move.reason, move.peak_before, move.peak_after,
        )  # fmt: skip

    def state(self) -> dict[str, Any]:
        names = {spec.url: spec.name for spec in self.board.specs}
        utilisation = self.controller.utilisation(self._roles())
        return {
            "mode": "role",
            "controller": "on" if self.enabled else "off",
            "moves": self.moves,
            "bytes_moved": self.bytes_moved,
            "utilisation": {str(r): round(u, 3) for r, u in utilisation.items()},
            "roles": {
                spec.name: {"home": spec.role, "role": str(self.board.role_of(spec.url))}
                for spec in self.board.specs
            },
            "history": [{"instance": names.get(m.url, m.url), **m.to_json()} for m in self.history],
        }

    async def handle_get(self, _: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def handle_post(self, request: web.Request) -> web.Response:
        try:
            call = admin_call(await request.read(), "role")
            if call.reset:
                self.reset()
            if call.instance is not None:
                self.move(call.instance, str(call.value))
            if call.controller is not None:
                self.enabled = call.controller == "on"
        except MigrationRefused as exc:
            return web.json_response({"message": str(exc)}, status=exc.status)
        return web.json_response(self.state())
