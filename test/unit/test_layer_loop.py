"""``--migration layer``'s loop in the gateway, in process: the admin's moves, resets and
checks through ``POST /migration``, a controller step's move reaching the instance, and an
instance that restarted whole leaving the controller's hands. The split instance is a small
aiohttp app answering ``/pp_boundary`` as a real one does (applied at once); the real one is
``e2e/test_cluster_layer.py``'s."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from banaserve.cluster.layer_layout import LayerLayout
from banaserve.cluster.layer_loop import LayerMigration, split_instances
from banaserve.cluster.load_board import LoadBoard
from banaserve.cluster.topology import lend_decode_layers, plan_instances
from banaserve.config.pipeline_options import LayerSplit
from banaserve.migration.layer_controller import LayerController, LayerControllerConfig
from banaserve.router.load import InstanceLoad
from banaserve.server.kv_pool_sizing import layer_weight_bytes
from banaserve.utils.processes import free_port
from support.gateway import gateway_for, post

SPLIT = LayerSplit(15, 30)
CONFIG = {"num_hidden_layers": 30, "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}  # fmt: skip


class FakeSplitInstance:
    """``GET``/``POST /pp_boundary`` of a split instance whose moves apply at once."""

    def __init__(self, boundary: int) -> None:
        self.boundary = boundary
        self.posts: list[int] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/pp_boundary", self.get)
        app.router.add_post("/pp_boundary", self.post)
        return app

    def state(self) -> dict[str, int]:
        boundary, layers = self.boundary, SPLIT.num_layers
        return {"requested": boundary, "applied": boundary, "min_boundary": 1,
                "num_layers": layers, "moves": len(self.posts), "bytes_moved": 0}  # fmt: skip

    async def get(self, _: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def post(self, request: web.Request) -> web.Response:
        self.boundary = (await request.json())["boundary"]
        self.posts.append(self.boundary)
        return web.json_response(self.state())


Running = tuple[str, LayerMigration, FakeSplitInstance]


@asynccontextmanager
async def cluster(tmp_path: Path, **config: Any) -> AsyncIterator[Running]:
    """A gateway over 2P+1D on two cores whose decode-0 is split (a fake instance)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    ports = [free_port() for _ in range(3)]
    specs = lend_decode_layers(plan_instances(2, 1, ports, [(0,), (1,), (0,)]), SPLIT)
    board = LoadBoard(specs)
    layout = LayerLayout.of(specs, SPLIT)
    migration = LayerMigration.for_cluster(board, specs, SPLIT, layout, tmp_path, "float32")
    if config:
        migration.controller = LayerController(
            split_instances(specs, SPLIT, layer_weight_bytes(tmp_path)),
            cores={s.url: s.cores for s in specs[:2]}, config=LayerControllerConfig(**config),
            boundary={specs[2].url: SPLIT.boundary},
        )  # fmt: skip
    instance = FakeSplitInstance(SPLIT.boundary)
    runner = web.AppRunner(instance.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", ports[2]).start()
    try:
        async with gateway_for(specs, board=board, migration=migration) as url:
            yield url, migration, instance
    finally:
        await runner.cleanup()


def test_the_admin_moves_the_boundary_and_resets_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as (url, migration, instance):
            status, text = await post(f"{url}/migration", {"instance": "decode-0", "boundary": 10})
            assert status == 200, text
            state = json.loads(text)
            assert instance.posts == [10] and state["boundaries"] == {"decode-0": 10}
            assert state["moves"] == 1 and state["controller"] == "on"
            # Down 15 -> 10: five layers' weights; the stages map the KV, so none of it moves.
            assert state["bytes_moved"] == 5 * layer_weight_bytes(tmp_path)
            assert state["history"][-1] | {"at": 0} == {
                "instance": "decode-0", "url": migration.board.specs[2].url, "from": 15,
                "to": 10, "at": 0, "peak_before": 0.0, "peak_after": 0.0,
                "bytes_moved": 5 * layer_weight_bytes(tmp_path), "reason": "admin",
            }  # fmt: skip
            status, text = await post(f"{url}/migration", {"instance": "decode-0", "boundary": 30})
            assert status == 200 and json.loads(text)["bytes_moved"] == 5 * layer_weight_bytes(
                tmp_path
            )  # up: nothing sent
            status, text = await post(f"{url}/migration", {"reset": True, "controller": "off"})
            assert status == 200, text
            state = json.loads(text)
            assert instance.posts == [10, 30, 15] and state["boundaries"] == {"decode-0": 15}
            assert state["controller"] == "off"

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [({"instance": "decode-0", "boundary": 0}, 400, "between 1 and 30"),
     ({"instance": "decode-0", "boundary": 31}, 400, "between 1 and 30"),
     ({"instance": "decode-0", "boundary": "9"}, 400, "must be an integer"),
     ({"instance": "decode-9", "boundary": 9}, 400, "no instance named 'decode-9'"),
     ({"instance": "prefill-0", "boundary": 9}, 409, "does not run as two stages"),
     ({"instance": "decode-0"}, 400, "go together"),
     ({"instance": "decode-0", "boundary": 9, "reset": True}, 400, "go separately"),
     ({"controller": "maybe"}, 400, "'on' or 'off'"), ({"role": "decode"}, 400, "unknown"),
     ({}, 400, "expected a JSON object")],
)  # fmt: skip
def test_a_bad_admin_call_changes_nothing(
    tmp_path: Path, body: dict, status: int, message: str
) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as (url, migration, instance):
            got, text = await post(f"{url}/migration", body)
            assert got == status and message in json.loads(text)["message"], text
            assert instance.posts == [] and migration.layout.moves == 0
            assert migration.controller.boundary == {migration.board.specs[2].url: 15}

    asyncio.run(scenario())


def test_a_controller_step_moves_the_instance(tmp_path: Path) -> None:
    """Decode-0 busy and prefill-1 (whose core runs decode-0's layers [15, 30)) prefilling:
    the controller gives the borrowed core back (k = L), and the instance is asked for that
    boundary."""

    async def scenario() -> None:
        eager = {"sustain_s": 0, "dwell_s": 0, "smoothing": 1}
        async with cluster(tmp_path, **eager) as (_, migration, instance):
            decode = migration.board.specs[2].url
            lender = migration.board.specs[1].url
            migration.board.loads[decode] = InstanceLoad(decode, "decode", running_reqs=4)
            migration.board.loads[lender] = InstanceLoad(lender, "prefill", running_reqs=2)
            moves = await migration.tick()
            assert [(m.to_boundary, m.reason) for m in moves] == [(30, "lent cores prefill")]
            assert instance.posts == [moves[0].to_boundary]
            assert migration.layout.boundaries == {"decode-0": 15}  # read before the move
            await migration.refresh()
            assert migration.layout.boundaries == {"decode-0": moves[0].to_boundary}
            migration.enabled = False
            assert await migration.tick() == []

    asyncio.run(scenario())


def test_an_instance_restarted_whole_is_no_longer_moved(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as (url, migration, instance):
            whole = migration.board.specs[2].unsplit
            migration.record_fallback(whole, at=3.0)
            assert migration.controller.splits == []
            status, text = await post(f"{url}/migration", {"instance": "decode-0", "boundary": 9})
            assert status == 409 and "does not run as two stages" in text
            state = json.loads((await post(f"{url}/migration", {"controller": "on"}))[1])
            assert state["boundaries"] == {"decode-0": 30}
            assert state["history"][-1]["reason"].startswith("the instance died")
            assert instance.posts == []

    asyncio.run(scenario())


def test_the_lent_core_neighbours_the_split_instance_only_while_it_lends(tmp_path: Path) -> None:
    """Routing counts a split instance's requests on prefill-1's core while layers run there;
    at k = L its stage 1 idles, and prefill-1 no longer has a neighbour."""

    def peers(migration: LayerMigration) -> dict[str, int]:
        loads = migration.board.candidates("prefill")
        return {migration.name_of(load.url): load.core_peer_reqs for load in loads}

    async def scenario() -> None:
        async with cluster(tmp_path) as (url, migration, _):
            decode = migration.board.specs[2].url
            migration.board.loads[decode] = InstanceLoad(decode, "decode", running_reqs=3)
            assert peers(migration) == {"prefill-0": 3, "prefill-1": 3}  # at 15: both cores
            for boundary, lent in ((30, 0), (10, 3)):
                move = {"instance": "decode-0", "boundary": boundary}
                status, text = await post(f"{url}/migration", move)
                assert status == 200, text
                await migration.refresh()  # as the instance reports it
                assert peers(migration) == {"prefill-0": 3, "prefill-1": lent}, boundary

    asyncio.run(scenario())


def test_the_predictive_mode_reads_the_admitted_requests(tmp_path: Path) -> None:
    """One decode is a core's worth: nothing to lend, until requests asking for many output
    tokens start arriving (a decode-heavy phase building up): then the split starts."""

    async def scenario() -> None:
        eager = {"sustain_s": 0, "dwell_s": 0, "smoothing": 1, "predictive": True,
                 "split_cost": 1.35}  # fmt: skip
        async with cluster(tmp_path, **eager) as (url, migration, instance):
            decode = migration.board.specs[2].url
            status, text = await post(f"{url}/migration", {"instance": "decode-0", "boundary": 30})
            assert status == 200 and json.loads(text)["predictive"] is True, text
            migration.board.loads[decode] = InstanceLoad(decode, "decode", running_reqs=1)
            assert await migration.tick() == []
            for _ in range(4):
                migration.arrived(prompt_tokens=32, output_tokens=128)
            moves = await migration.tick()
            assert [(m.reason, m.to_boundary < 30) for m in moves] == [("controller", True)]
            assert instance.posts == [30, moves[0].to_boundary]

    asyncio.run(scenario())
