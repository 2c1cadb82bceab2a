"""``GET`` and ``POST /pp_boundary`` on a two-stage instance whose layer boundary moves
(``--pp-min-boundary``; see :mod:`banaserve.platform.pp_movable`).

``GET`` answers the state: ``{"requested", "applied", "min_boundary", "num_layers",
"moves", "bytes_moved"}`` (``applied``: the boundary the last micro-batch ran at).
``POST {"boundary": k}`` (an admin call: with ``--admin-api-key``, SGLang asks for it as for
its own admin routes) asks for ``k`` (``min_boundary <= k <= num_layers``; ``k = L``
runs every layer on the first stage, and the second holds no layer weights) and answers the
state; the first stage moves before its next micro-batch. Anything else is a 400 that
changes nothing.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations.
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from banaserve.config.pipeline_options import split_from_env
from banaserve.env import MOVABLE_ENV, SPLIT_DIR_ENV
from banaserve.migration.boundary_control import (
    BoundaryControl,
    checked_boundary,
    remove_orphan_split_dirs,
)

ROUTE = "/pp_boundary"

logger = logging.getLogger("banaserve.server")


def state(control: BoundaryControl, lowest: int) -> dict[str, Any]:
    now = control.read()
    return {
        "requested": now.requested, "applied": now.applied, "min_boundary": lowest,
        "num_layers": now.num_layers, "moves": now.moves, "bytes_moved": now.bytes_moved,
    }  # fmt: skip


def boundary_asked(body: object, lowest: int, layers: int) -> int:
    """The boundary a POST body asks for; ValueError (its message is the 400's) otherwise."""
    if not isinstance(body, dict) or set(body) != {"boundary"}:
        raise ValueError('the body must be a JSON object {"boundary": k}')
    return checked_boundary(body["boundary"], lowest, layers)


def add_boundary_route(env: Mapping[str, str]) -> Path:
    """Create the split folder and its record at the split ``env`` starts with, add the
    routes to SGLang's app, and return the folder (the caller removes it at exit)."""
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.utils.auth import AuthLevel, auth_level

    removed = remove_orphan_split_dirs()
    if removed:
        logger.info("removed %d split folders of launchers that are gone", len(removed))
    split = split_from_env(env)
    lowest = int(env[MOVABLE_ENV])
    folder = Path(env[SPLIT_DIR_ENV])
    control = BoundaryControl(folder, create=True, boundary=split.boundary,
                              num_layers=split.num_layers)  # fmt: skip

    async def get_boundary() -> JSONResponse:
        return JSONResponse(state(control, lowest))

    @auth_level(AuthLevel.ADMIN_OPTIONAL)  # a move is an admin call (--admin-api-key)
    async def post_boundary(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:  # not JSON at all
            body = None
        try:
            boundary = boundary_asked(body, lowest, split.num_layers)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        control.request(boundary)
        return JSONResponse(state(control, lowest))

    app.add_api_route(ROUTE, get_boundary, methods=["GET"])
    app.add_api_route(ROUTE, post_boundary, methods=["POST"])
    return folder
