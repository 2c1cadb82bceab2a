"""``--migration role``: the role controller's decisions over load records on an injected
clock (the gateway runs the same code), the board relabelling instances, and the gateway's
loop and admin API over them."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from banaserve.cluster.role_loop import RoleMigration
from banaserve.migration.role_controller import RoleController, RoleControllerConfig
from banaserve.router import Board, Placer, RequestShape, Role, Router, make_policy
from banaserve.router.load import InstanceLoad

P0, P1, D0 = "http://p0", "http://p1", "http://d0"
#: BanaServe's 2P+1D layout on two cores: prefill-0 and decode-0 share core 0.
CORES = {P0: (0,), P1: (1,), D0: (0,)}
HOME = {P0: Role.PREFILL, P1: Role.PREFILL, D0: Role.DECODE}


def loads(roles: dict[str, Role], batch: dict[str, int],
          prompt_tokens: dict[str, int] | None = None) -> list[InstanceLoad]:  # fmt: skip
    """Each instance in its current role with ``batch`` requests, ``prompt_tokens`` of them
    queued prompt tokens."""
    queued = prompt_tokens or {}
    return [InstanceLoad(url, str(role), running_reqs=batch.get(url, 0),
                         queued_prefill_tokens=queued.get(url, 0))
            for url, role in roles.items()]  # fmt: skip


def controller(**config: float) -> RoleController:
    return RoleController(RoleControllerConfig(**config), cores=CORES, home=HOME)


def run(ctl: RoleController, roles: dict[str, Role], batch: dict[str, int], start: float,
        seconds: int, prompt_tokens: dict[str, int] | None = None) -> list:  # fmt: skip
    """One step a second; moves applied to ``roles``."""
    moves = []
    for t in range(seconds):
        for move in ctl.step(loads(roles, batch, prompt_tokens), start + t):
            roles[move.url] = move.to_role
            moves.append(move)
    return moves


def test_long_decodes_move_the_prefill_instance_on_its_own_core() -> None:
    roles = dict(HOME)
    moves = run(controller(), roles, {D0: 6}, 0.0, 5)
    assert [(m.url, m.from_role, m.to_role) for m in moves] == [(P1, Role.PREFILL, Role.DECODE)]
    assert moves[0].peak_after < moves[0].peak_before and moves[0].bytes_moved == 0
    # Not prefill-0: it shares decode-0's core, so as a decode instance it would add nothing.
    assert roles[P0] == Role.PREFILL


def test_an_idle_or_balanced_cluster_stays_as_started() -> None:
    assert run(controller(), dict(HOME), {}, 0.0, 30) == []
    assert run(controller(), dict(HOME), {P0: 1, P1: 1, D0: 1}, 0.0, 30) == []
    # One lone request: its smoothed demand reaches exactly min_peak, which moves nothing.
    assert run(controller(), dict(HOME), {D0: 1}, 0.0, 120) == []


def test_no_flapping_and_the_instance_goes_home_when_prompts_pile_up() -> None:
    ctl, roles = controller(dwell_s=10.0), dict(HOME)
    assert len(run(ctl, roles, {D0: 6}, 0.0, 3)) == 1  # prefill-1 decodes now
    batch = {D0: 3, P1: 3, P0: 1}  # one prefill step on prefill-0: its role is busy now
    assert run(ctl, roles, batch, 3.0, 30) == []  # moving either back would not cut the peak
    piled = {P0: 5, D0: 1, P1: 0}  # prompts pile up on the one prefill instance
    moves = run(ctl, roles, piled, 33.0, 5)
    assert [(m.url, m.to_role) for m in moves] == [(P1, Role.PREFILL)]  # home, the idle one


def test_a_moved_instance_dwells_before_it_moves_again() -> None:
    ctl, roles = controller(dwell_s=20.0, cooldown_s=0.0), dict(HOME)
    assert len(run(ctl, roles, {D0: 6}, 0.0, 2)) == 1
    assert run(ctl, roles, {P0: 5}, 2.0, 15) == []  # would go back, but dwells until t=20
    assert [m.url for m in run(ctl, roles, {P0: 5}, 17.0, 6)] == [P1]


def test_one_prefill_and_one_decode_instance_mix_and_unmix() -> None:
    """1P+1D, a core each: the only prefill instance cannot leave prefill work, so under long
    decodes it takes decodes too (mixed); when prompts pile up, it is a prefill instance again."""
    roles = {P0: Role.PREFILL, D0: Role.DECODE}
    ctl = RoleController(RoleControllerConfig(dwell_s=5.0), cores={P0: (0,), D0: (1,)},
                         home=dict(roles))  # fmt: skip
    moves = run(ctl, roles, {D0: 8}, 0.0, 4)
    assert [(m.url, m.to_role) for m in moves] == [(P0, Role.MIXED)]
    # Four long prompts queue on the mixed instance, one decode left on decode-0: prefill-0
    # goes home first; with the prompts still queued, the nearly idle decode-0 then takes
    # prefill steps too. Nothing moves twice within its dwell.
    back = run(ctl, roles, {P0: 4, D0: 1}, 10.0, 5, prompt_tokens={P0: 4 * 1024})
    assert [(m.url, m.to_role) for m in back] == [(P0, Role.PREFILL), (D0, Role.MIXED)]
    assert back[1].at - back[0].at >= ctl.config.cooldown_s


def test_each_kind_of_work_keeps_an_instance() -> None:
    roles = {P0: Role.PREFILL, D0: Role.DECODE}
    ctl = RoleController(home=dict(roles))  # no cores given: an instance counts as one core
    moves = run(ctl, roles, {P0: 20}, 0.0, 30)
    assert all(m.to_role == Role.MIXED for m in moves) and roles[P0] == Role.PREFILL
    assert ctl.keeps_every_step({P0: Role.MIXED}) and not ctl.keeps_every_step({P0: Role.DECODE})


def test_an_unhealthy_instance_is_neither_moved_nor_counted() -> None:
    records = loads(dict(HOME), {D0: 6})
    records[1] = InstanceLoad(P1, "prefill", healthy=False)
    assert controller().step(records, 0.0) == []  # prefill-0 is the only healthy prefill


def test_bad_config_is_refused() -> None:
    for bad in ({"smoothing": 0}, {"min_gain": 1}, {"decode_full_reqs": 0}, {"min_per_role": 0},
                {"dwell_s": -1}, {"prefill_unit_tokens": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            RoleControllerConfig(**bad)


# -- the board and the gateway's loop ---------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    name: str
    role: str
    url: str
    cores: tuple[int, ...] = ()


SPECS = [Spec("prefill-0", "prefill", P0, (0,)), Spec("prefill-1", "prefill", P1, (1,)),
         Spec("decode-0", "decode", D0, (0,))]  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_relabelled_instance_is_routed_in_its_new_role() -> None:
    board = Board(SPECS, clock=Clock())
    router = Router(board, make_policy("load_aware", "prefill"),
                    make_policy("load_aware", "decode"), Placer())  # fmt: skip
    shape = RequestShape("/generate", "a long answer", 4, False, 128)
    busy = router.pick(Role.DECODE, shape)
    assert busy.url == D0
    assert board.set_role(P1, Role.DECODE) == Role.PREFILL
    assert router.pick(Role.DECODE, shape).url == P1  # decode-0 is busy with the first
    assert [c.url for c in board.candidates(Role.PREFILL)] == [P0]
    board.record_poll(SPECS[1], {"loads": [{"num_running_reqs": 1}]})
    assert board.loads[P1].role == "decode"  # a poll keeps the current role
    board.set_role(P0, Role.MIXED)  # takes both steps now
    assert router.pick(Role.PREFILL, shape).url == P0 and router.can_prefill()
    # A serve-step candidate too (it shares decode-0's core, so it ranks after prefill-1 and
    # decode-0 in the load order).
    assert router.pick(Role.DECODE, shape, tried={D0, P1}).url == P0


class Request:
    """The part of aiohttp's request the admin handler reads."""

    def __init__(self, body: object) -> None:
        self.body = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def read(self) -> bytes:
        return self.body


def post(migration: RoleMigration, body: object) -> tuple[int, dict]:
    response = asyncio.run(migration.handle_post(Request(body)))  # type: ignore[arg-type]
    return response.status, json.loads(response.body)


def test_the_loop_applies_the_controllers_moves_to_the_board() -> None:
    clock = Clock()
    board = Board(SPECS, clock=clock)
    migration = RoleMigration.for_board(board)
    migration.clock = clock
    for _ in range(6):
        board.begin(D0, 0)  # six long decodes in flight on decode-0
    moves = []
    for _ in range(3):
        moves += migration.tick()
        clock.now += 1.0
    assert [m.url for m in moves] == [P1] and board.role_of(P1) == Role.DECODE
    state = migration.state()
    assert state["moves"] == 1 and state["roles"]["prefill-1"] == {
        "home": "prefill",
        "role": "decode",
    }
    assert state["history"][0]["instance"] == "prefill-1"


def test_the_admin_api_moves_by_hand_and_refuses_clearly() -> None:
    clock = Clock()
    board = Board(SPECS, clock=clock)
    migration = RoleMigration.for_board(board)
    migration.clock = clock
    status, state = post(migration, {"controller": "off"})
    assert status == 200 and state["controller"] == "off"
    for _ in range(6):
        board.begin(D0, 0)
    assert migration.tick() == []  # the controller is off
    status, state = post(migration, {"instance": "prefill-1", "role": "decode"})
    assert status == 200 and board.role_of(P1) == Role.DECODE
    assert state["history"][-1]["reason"] == "admin"
    refusals = {
        "prefill-1 already serves as decode": {"instance": "prefill-1", "role": "decode"},
        "would leave no healthy instance for prefill": {"instance": "prefill-0", "role": "decode"},
        "no instance named 'nope'": {"instance": "nope", "role": "decode"},
        "'role' must be one of 'prefill', 'decode', 'mixed'": {
            "instance": "prefill-0",
            "role": "both",
        },
        "go together": {"instance": "prefill-0"},
        "'controller' must be 'on' or 'off'": {"controller": True},
        "unknown field": {"k": 3},
        "'reset' must be true": {"reset": 1},
        "go separately": {"reset": True, "instance": "prefill-1", "role": "prefill"},
        "expected a JSON object": [1],
        "invalid JSON": b"{nope",
    }
    for message, body in refusals.items():
        status, answer = post(migration, body)
        assert status in (400, 409) and message in answer["message"], (body, answer)
    # Nothing changed: prefill-1 is still moved (the refused reset+move did not reset it).
    assert board.role_of(P0) == Role.PREFILL and board.role_of(P1) == Role.DECODE
    assert migration.moves == 1
    status, state = post(migration, {"reset": True})
    assert status == 200 and state["roles"]["prefill-1"] == {"home": "prefill", "role": "prefill"}
    assert migration.controller.demand == {Role.PREFILL: 0.0, Role.DECODE: 0.0}


# -- the gateway's /migration over real sockets -----------------------------------------------


def test_the_gateway_routes_by_the_roles_posted_to_migration() -> None:
    from aiohttp import web

    from banaserve.cluster.load_board import LoadBoard
    from banaserve.cluster.topology import InstanceSpec
    from support.gateway import gateway_for, post, upstream

    seen: list[int] = []

    def recording(port: list[int]):  # noqa: ANN202
        async def handler(request: web.Request) -> web.Response:
            await request.json()
            seen.append(port[0])
            return web.json_response({"text": "ok"})

        return handler

    async def scenario() -> None:
        p0, p1, d0 = [0], [0], [0]
        async with upstream(recording(p0)) as p0[0], upstream(recording(p1)) as p1[0], \
                upstream(recording(d0)) as d0[0]:  # fmt: skip
            specs = [InstanceSpec("prefill-0", "prefill", p0[0]),
                     InstanceSpec("prefill-1", "prefill", p1[0]),
                     InstanceSpec("decode-0", "decode", d0[0])]  # fmt: skip
            board = LoadBoard(specs)
            async with gateway_for(specs, board, migration=RoleMigration.for_board(board)) as url:
                short_long_output = {"text": "hi", "sampling_params": {"max_new_tokens": 99}}
                assert (await post(f"{url}/generate", short_long_output))[0] == 200
                status, _ = await post(f"{url}/migration",
                                       {"instance": "prefill-1", "role": "decode"})  # fmt: skip
                assert status == 200
                status, _ = await post(f"{url}/migration",
                                       {"instance": "decode-0", "role": "prefill"})  # fmt: skip
                assert status == 200
                assert (await post(f"{url}/generate", short_long_output))[0] == 200
            async with gateway_for(specs) as url:  # --migration off
                status, text = await post(f"{url}/migration", {"controller": "off"})
                assert status == 409 and "--migration role" in text
        assert seen == [d0[0], p1[0]]  # decode-0 serves, then prefill-1 in its place

    asyncio.run(scenario())
