"""``--migration layer`` in the gateway: every :data:`TICK_S` the layer controller
(:mod:`banaserve.migration.layer_controller`) reads the board's records and may move a split
instance's boundary, which the gateway asks of the instance (``POST /pp_boundary``: see
:mod:`banaserve.platform.pp_movable`); ``GET /migration`` reports the layout, where each
boundary is (as the instances report it) and the history, ``POST /migration`` is the
admin's.

``POST /migration`` takes a JSON object with either or both of:

- ``"controller": "on" | "off"``: whether the controller moves boundaries;
- ``"instance": NAME, "boundary": K``: move that split instance's boundary now (it then
  dwells there like after a controller move); 409 for an instance that is not split (any
  more);
- ``"reset": true``: every split instance back to the boundary it started at, and the
  controller's memory forgotten, as between two benchmark runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from banaserve.cluster.layer_layout import LayerLayout
from banaserve.cluster.migration_loop import TICK_S, MigrationRefused, admin_call
from banaserve.cluster.topology import MIN_BOUNDARY, InstanceSpec
from banaserve.config.pipeline_options import LayerSplit
from banaserve.migration.arrival_trend import ArrivalTrend
from banaserve.migration.boundary_control import checked_boundary
from banaserve.migration.layer_controller import (
    LayerController,
    LayerControllerConfig,
    LayerMove,
    SplitInstance,
)
from banaserve.router.board import Board
from banaserve.server.kv_pool_sizing import layer_weight_bytes

logger = logging.getLogger("banaserve.cluster")

#: Seconds an instance has to answer a boundary move or a state read.
INSTANCE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LayerLending:
    """What ``--migration layer`` decided before anything started: the split each decode
    instance starts at, the layout ``/migration`` reports (updated in place), and the dtype
    the instances run (which sizes a layer's weights)."""

    split: LayerSplit
    layout: LayerLayout
    dtype: str


def split_instances(specs: list[InstanceSpec], split: LayerSplit, weight_bytes: int,
                    ) -> list[SplitInstance]:  # fmt: skip
    """The controller's view of each pinned split instance: layers [0, k) on its own cores,
    [k, L) on the ones it borrows. A move sends weights only: the stages map the KV."""
    out = []
    for spec in specs:
        if spec.unsplit is None or not spec.cores or not spec.unsplit.cores:
            continue
        home = spec.unsplit.cores
        out.append(SplitInstance(
            spec.url, split.num_layers, home, spec.cores[len(home):], MIN_BOUNDARY,
            layer_weight_bytes=weight_bytes, kv_bytes_per_token_layer=0,
        ))  # fmt: skip
    return out


class LayerMigration:
    """The controller's loop and the admin API of one cluster's split instances.

    Owns the controller and the layout (:class:`banaserve.cluster.layer_layout.LayerLayout`,
    which ``state`` reports); the board is the gateway's. Confined to the
    gateway's event loop: nothing is locked; a tick waits for the instances' answers
    (at most :data:`INSTANCE_TIMEOUT_S` each).
    """

    def __init__(self, board: Board, controller: LayerController, layout: LayerLayout,
                 clock: Callable[[], float] = time.monotonic,
                 instance_headers: Mapping[str, str] | None = None,
                 admin_headers: Mapping[str, str] | None = None) -> None:  # fmt: skip
        self.board = board
        self.instance_headers = dict(instance_headers or {})  # on every call to an instance
        self.admin_headers = dict(admin_headers or {})  # on a move, an admin call there
        self.controller = controller
        self.layout = layout
        self.clock = clock
        self.enabled = True
        self.trend = ArrivalTrend()  # read only in the controller's predictive mode
        self._by_name = {spec.name: spec for spec in board.specs}
        self._session: aiohttp.ClientSession | None = None
        for split in controller.splits:
            self._computes_at(split.url, controller.boundary[split.url])

    @classmethod
    def for_cluster(
        cls, board: Board, specs: list[InstanceSpec], split: LayerSplit, layout: LayerLayout,
        model_path: Path, dtype: str, config: LayerControllerConfig | None = None,
        instance_headers: Mapping[str, str] | None = None,
        admin_headers: Mapping[str, str] | None = None,
    ) -> LayerMigration:  # fmt: skip
        splits = split_instances(specs, split, layer_weight_bytes(model_path, dtype))
        split_urls = {s.url for s in splits}
        cores = {s.url: tuple(s.cores) for s in specs if s.cores and s.url not in split_urls}
        controller = LayerController(
            splits, cores=cores, config=config or LayerControllerConfig(),
            boundary={s.url: split.boundary for s in splits},
        )  # fmt: skip
        return cls(board, controller, layout, instance_headers=instance_headers,
                   admin_headers=admin_headers)  # fmt: skip

    def arrived(self, prompt_tokens: int, output_tokens: int) -> None:
        self.trend.record(self.clock(), prompt_tokens, output_tokens)

    def name_of(self, url: str) -> str:
        return next((s.name for s in self.board.specs if s.url == url), url)

    def records(self) -> list[Any]:
        roles = {spec.role for spec in self.board.specs}
        return [load for role in sorted(roles) for load in self.board.candidates(role)]

    async def tick(self) -> list[LayerMove]:
        """One controller step, its moves asked of the instances (none while off); a move an
        instance does not take is forgotten (the controller keeps its boundary)."""
        await self.refresh()
        if not self.enabled:
            return []
        now = self.clock()
        moves = self.controller.step(self.records(), now, self.trend.forecast(now))
        for move in moves:
            if not await self._ask(move):
                self.controller.set_boundary(move.url, move.from_boundary)
        return moves

    async def run_forever(self) -> None:
        async with aiohttp.ClientSession(
            headers=self.instance_headers, timeout=aiohttp.ClientTimeout(total=INSTANCE_TIMEOUT_S)
        ) as session:
            self._session = session
            while True:
                await asyncio.sleep(TICK_S)
                try:
                    await self.tick()
                except Exception:  # a controller bug must not stop serving
                    logger.exception("layer migration step failed")

    async def refresh(self) -> None:
        """Each split instance's boundary as it reports it (``applied``: where its last
        micro-batch ran)."""
        for name in list(self.layout.start):
            url = self._by_name[name].url
            state = await self._call("GET", url)
            if state is not None and self.layout.is_split(name):
                self.layout.boundaries[name] = state["applied"]
                self._computes_at(url, state["applied"])

    def move(self, name: str, boundary: object) -> LayerMove:
        """The admin's move of ``name`` to ``boundary`` (checked, not yet asked)."""
        spec = self._by_name.get(name)
        if spec is None:
            raise MigrationRefused(
                f"no instance named {name!r}; instances: {sorted(self._by_name)}"
            )
        if not self.layout.is_split(name):
            raise MigrationRefused(f"{name} does not run as two stages (any more)", status=409)
        try:
            boundary = checked_boundary(boundary, MIN_BOUNDARY, self.layout.num_layers)
        except ValueError as exc:
            raise MigrationRefused(str(exc)) from None
        split = self.controller.split_of(spec.url)
        if split is None:
            raise MigrationRefused(f"{name} is not pinned: start the cluster with pinned cores "
                                   "to move its boundary", status=409)  # fmt: skip
        now = self.clock()
        before = self.controller.boundary[spec.url]
        peak = self.controller.peak(self.controller.boundary)
        after = self.controller.peak({**self.controller.boundary, spec.url: boundary})
        move = LayerMove(spec.url, before, boundary, now, peak, after,
                         split.move_bytes(before, boundary, 0), reason="admin")  # fmt: skip
        self.controller.set_boundary(spec.url, boundary)
        self.controller.moved_at[spec.url] = now
        return move

    async def reset(self) -> None:
        """Every split instance back at its start boundary; the controller starts afresh."""
        for name, boundary in self.layout.start.items():
            url = self._by_name[name].url
            if self.controller.boundary.get(url) != boundary:
                await self._call("POST", url, boundary)
                self.controller.set_boundary(url, boundary)
        self.controller.forget()
        self.trend.clear()
        logger.info("layer migration: every split instance back at its start boundary")

    def record_fallback(self, whole: InstanceSpec, at: float) -> None:
        """``whole`` restarted as one stage on its own cores (a stage died): the boundary is
        L for good and the controller no longer moves it."""
        self.layout.record_fallback(whole, at)
        if self.controller.split_of(whole.url) is not None:
            self.controller.retire(whole.url)

    def _computes_at(self, url: str, boundary: int) -> None:
        """Tell the board where ``url`` computes with ``boundary``: at L on its home cores
        only, so the lending instance's requests do not count as its neighbours'."""
        split = self.controller.split_of(url)
        if split is not None:
            lent = split.lent_cores if boundary < split.num_layers else ()
            self.board.computes_on(url, split.home_cores + lent)

    async def _ask(self, move: LayerMove) -> bool:
        """Ask the instance for ``move``'s boundary; True when it took it."""
        if await self._call("POST", move.url, move.to_boundary) is None:
            return False
        self.layout.record_move(self.name_of(move.url), move.to_json(), move.bytes_moved)
        logger.info(
            "layer migration: %s boundary %d -> %d (%s; peak utilisation %.2f -> %.2f)",
            self.name_of(move.url), move.from_boundary, move.to_boundary, move.reason,
            move.peak_before, move.peak_after,
        )  # fmt: skip
        return True

    async def _call(self, method: str, url: str, boundary: int | None = None) -> Any:
        """The instance's answer to ``/pp_boundary`` (JSON), or None when it gave none."""
        session = self._session
        temporary = session is None  # an admin call before the loop runs
        if session is None:
            session = aiohttp.ClientSession(
                headers=self.instance_headers,
                timeout=aiohttp.ClientTimeout(total=INSTANCE_TIMEOUT_S),
            )
        body = None if boundary is None else {"boundary": boundary}
        headers = self.admin_headers if method == "POST" else None
        try:
            async with session.request(
                method, f"{url}/pp_boundary", json=body, headers=headers
            ) as answer:
                if answer.status == 200:
                    return await answer.json()
                logger.warning("%s /pp_boundary of %s: %d %s", method, self.name_of(url),
                               answer.status, await answer.text())  # fmt: skip
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            logger.warning("%s /pp_boundary of %s failed: %s", method, self.name_of(url), exc)
        finally:
            if temporary:
                await session.close()
        return None

    def state(self) -> dict[str, Any]:
        utilisation = self.controller.utilisation(self.controller.boundary)
        return {
            **self.layout.to_json(),
            "controller": "on" if self.enabled else "off",
            "predictive": self.controller.config.predictive,
            "utilisation": {str(core): round(u, 3) for core, u in utilisation.items()},
        }

    async def handle_get(self, _: web.Request) -> web.Response:
        await self.refresh()  # the boundaries as the instances have them now, not a tick ago
        return web.json_response(self.state())

    async def handle_post(self, request: web.Request) -> web.Response:
        try:
            call = admin_call(await request.read(), "boundary")
            move = self.move(call.instance, call.value) if call.instance is not None else None
            if call.reset:
                await self.reset()
            if move is not None and not await self._ask(move):
                self.controller.set_boundary(move.url, move.from_boundary)
                raise MigrationRefused(f"{call.instance} did not take the move", status=502)
            if call.controller is not None:
                self.enabled = call.controller == "on"
        except MigrationRefused as exc:
            return web.json_response({"message": str(exc)}, status=exc.status)
        await self.refresh()
        return web.json_response(self.state())
