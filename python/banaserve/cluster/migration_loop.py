"""What the gateway's migration loops share: the protocol the gateway types them against, the
admin call both parse from ``POST /migration``, their refusal, tick and history length, and
their Prometheus lines. The loops: :mod:`banaserve.cluster.role_loop` (``--migration role``)
and :mod:`banaserve.cluster.layer_loop` (``--migration layer``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

#: Seconds between two controller steps.
TICK_S = 1.0
#: Moves kept for ``GET /migration``.
HISTORY = 200


class MigrationLoop(Protocol):
    """What the gateway needs of a ``--migration`` mode: its loop (run as a task until the
    gateway stops), its state (``/migration``, ``/cluster``, ``/metrics``: ``mode``,
    ``moves``, ``bytes_moved``, ``utilisation`` at least) and the admin calls. Confined to
    the gateway's event loop."""

    async def run_forever(self) -> None: ...

    def state(self) -> dict[str, Any]: ...

    async def handle_get(self, request: web.Request) -> web.Response: ...

    async def handle_post(self, request: web.Request) -> web.Response: ...

    def arrived(self, prompt_tokens: int, output_tokens: int) -> None:
        """A request was admitted (what a predictive mode reads its trend from)."""


@dataclass(frozen=True)
class AdminCall:
    """A checked ``POST /migration`` body: turn the controller ``"on"`` or ``"off"`` (or
    leave it), move ``instance`` to ``value`` (a role or a boundary, checked by the mode),
    and or ``reset``."""

    controller: str | None
    instance: str | None
    value: object
    reset: bool


def admin_call(raw: bytes, target: str) -> AdminCall:
    """``raw`` as an :class:`AdminCall` whose move names its ``target`` field ("role",
    "boundary"). Raises MigrationRefused (400) saying what is wrong, invalid JSON included."""
    try:
        body = json.loads(raw or b"{}")
    except json.JSONDecodeError as exc:
        raise MigrationRefused(f"invalid JSON: {exc}") from None
    if not isinstance(body, dict) or not body:
        raise MigrationRefused(
            f"expected a JSON object with 'controller' and/or 'instance' and '{target}', or 'reset'"
        )
    unknown = set(body) - {"controller", "instance", target, "reset"}
    if unknown:
        raise MigrationRefused(f"unknown field(s) {sorted(unknown)}")
    controller = body.get("controller")
    if controller not in (None, "on", "off"):
        raise MigrationRefused(f"'controller' must be 'on' or 'off', got {controller!r}")
    if ("instance" in body) != (target in body):
        raise MigrationRefused(f"'instance' and '{target}' go together")
    reset = body.get("reset", False)
    if not isinstance(reset, bool):
        raise MigrationRefused(f"'reset' must be true, got {reset!r}")
    if reset and "instance" in body:
        # Refused before either is applied: a move checked against the state before the
        # reset could be one the reset makes impossible, or a no-op.
        raise MigrationRefused(f"'reset' and a move ('instance', '{target}') go separately")
    instance = str(body["instance"]) if "instance" in body else None
    return AdminCall(controller, instance, body.get(target), reset)


class MigrationRefused(Exception):
    """An admin move that cannot be made; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def migration_metrics(state: dict[str, Any]) -> list[str]:
    """Prometheus lines of a :class:`MigrationLoop`'s state."""
    lines = ["# HELP banaserve_migration_moves_total Instances moved between roles.",
             "# TYPE banaserve_migration_moves_total counter",
             f"banaserve_migration_moves_total {state['moves']}",
             "# HELP banaserve_migration_bytes_moved_total Bytes copied by migration moves.",
             "# TYPE banaserve_migration_bytes_moved_total counter",
             f"banaserve_migration_bytes_moved_total {state['bytes_moved']}",
             "# HELP banaserve_migration_utilisation Smoothed utilisation of each role (role "
             "migration) or core (layer migration).",
             "# TYPE banaserve_migration_utilisation gauge"]  # fmt: skip
    label = "role" if state.get("mode") == "role" else "core"
    for key, value in state["utilisation"].items():
        lines.append(f'banaserve_migration_utilisation{{{label}="{key}"}} {float(value):g}')
    return lines
