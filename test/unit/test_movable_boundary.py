"""The movable layer boundary without a server: its shared record, the route's checks, its
environment (the launcher's plan: ``test_pp_options.py``), and the platform's pieces
(widened layer ranges, the KV both stages map, each stage's side of a move) on small torch
modules. Served end to end: ``e2e/test_pp_movable.py``."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

from banaserve.config.pipeline_options import LayerSplit, movable_env, split_from_env
from banaserve.env import LAYER_PARTITION_ENV, MOVABLE_ENV, SPLIT_DIR_ENV
from banaserve.migration.boundary_control import (
    BoundaryControl,
    BoundaryState,
    remove_orphan_split_dirs,
    split_dir_for,
)
from banaserve.platform import import_hook, pp_movable
from banaserve.server.boundary_route import boundary_asked

LAYERS = 8


def test_the_record_is_shared_by_every_process_that_maps_it(tmp_path: Path) -> None:
    server = BoundaryControl(tmp_path / "split", create=True, boundary=6, num_layers=LAYERS)
    stage = BoundaryControl(tmp_path / "split")  # another mapping of the same file
    assert stage.read() == BoundaryState(6, 6, 0, 0, LAYERS)
    server.request(3)
    assert stage.read().requested == 3
    stage.record_applied(3, moves=1, bytes_moved=1000)
    assert server.read() == BoundaryState(3, 3, 1, 1000, LAYERS)


def test_split_folders_of_launchers_that_are_gone_are_removed(tmp_path: Path) -> None:
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
    mine = split_dir_for(os.getpid()).name
    for name in (mine, f"banaserve-split-{gone}", "banaserve-split-x", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mapped0").touch()
    assert remove_orphan_split_dirs(tmp_path) == [tmp_path / f"banaserve-split-{gone}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine, "banaserve-split-x",
                                                                 "other"])  # fmt: skip


@pytest.mark.parametrize("boundary", [2, 5, LAYERS])
def test_a_boundary_in_range_is_taken(boundary: int) -> None:
    assert boundary_asked({"boundary": boundary}, 2, LAYERS) == boundary


@pytest.mark.parametrize(
    ("body", "message"),
    [({"boundary": 1}, "out of range: this instance moves it between 2 and 8"),
     ({"boundary": 9}, "out of range"), ({"boundary": "4"}, "must be an integer"),
     ({"boundary": True}, "must be an integer"), ({"boundary": 4.0}, "must be an integer"),
     ({}, "JSON object"), ({"boundary": 4, "k": 4}, "JSON object"), ([4], "JSON object"),
     (None, "JSON object")],
)  # fmt: skip
def test_a_bad_body_says_what_is_wrong(body: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        boundary_asked(body, 2, LAYERS)


def test_the_movable_environment(tmp_path: Path) -> None:
    split = LayerSplit(6, LAYERS)
    assert movable_env(split, None, tmp_path) == {}
    assert movable_env(split, 2, tmp_path) == {MOVABLE_ENV: "2", SPLIT_DIR_ENV: str(tmp_path)}
    assert movable_env(split, 6, tmp_path)[MOVABLE_ENV] == "6"
    with pytest.raises(ValueError, match="give both"):
        movable_env(None, 2, tmp_path)
    for bad in (0, 7):
        with pytest.raises(ValueError, match="must be between 1 and --pp-layer-boundary"):
            movable_env(split, bad, tmp_path)
    assert split_from_env({LAYER_PARTITION_ENV: "6,2"}) == split


def test_each_stage_builds_every_layer_it_may_run(monkeypatch: pytest.MonkeyPatch) -> None:
    even = pp_movable.widened(lambda layers, rank, size: (rank * layers // size,
                                                          (rank + 1) * layers // size))  # fmt: skip
    monkeypatch.delenv(MOVABLE_ENV, raising=False)
    assert even(LAYERS, 1, 2) == (4, 8)  # not movable: SGLang's own split
    monkeypatch.setenv(MOVABLE_ENV, "2")
    assert even(LAYERS, 0, 2) == (0, LAYERS)
    assert even(LAYERS, 1, 2) == (2, LAYERS)
    assert even(LAYERS, 1, 4) == (2, 4)  # only a two-stage pipeline moves


def fused_pool(start: int, layers: int, slots: int = 5) -> types.SimpleNamespace:
    """A pool shaped like SGLang's MHA pool: K and V of a layer halves of one allocation."""
    fused = [torch.zeros(2, slots, 2, 3) for _ in range(layers)]
    return types.SimpleNamespace(
        start_layer=start, layer_num=layers,
        k_buffer=[buf[0] for buf in fused], v_buffer=[buf[1] for buf in fused],
    )  # fmt: skip


def test_both_stages_see_the_kv_of_the_shared_layers(tmp_path: Path) -> None:
    first, second = fused_pool(0, LAYERS), fused_pool(2, LAYERS - 2)
    pp_movable.share_layers(first, 2, tmp_path)
    pp_movable.share_layers(second, 2, tmp_path)
    first.k_buffer[5][3] = 1.5  # layer 5, slot 3, written by stage 0
    second.v_buffer[3 - 2][1] = 2.5  # layer 3, slot 1, written by stage 1
    assert torch.all(second.k_buffer[5 - 2][3] == 1.5)
    assert torch.all(first.v_buffer[3][1] == 2.5)
    assert torch.all(first.k_buffer[3][1] == 0)  # V's write stays out of K
    first.k_buffer[1][0] = 9.0  # layer 1 is stage 0's alone: not in a file
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"kv{n}" for n in range(2, LAYERS)]
    pp_movable.unlink_once_both_mapped(tmp_path, 0, [f"kv{n}" for n in range(2, LAYERS)])
    assert len(list(tmp_path.glob("kv*"))) == LAYERS - 2  # stage 1 has not said it mapped
    pp_movable.unlink_once_both_mapped(tmp_path, 1, [f"kv{n}" for n in range(2, LAYERS)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mapped0", "mapped1"]
    first.k_buffer[4][0] = 7.0  # the mappings outlive the names
    assert torch.all(second.k_buffer[2][0] == 7.0)


def test_pools_of_different_sizes_are_refused(tmp_path: Path) -> None:
    pp_movable.share_layers(fused_pool(0, LAYERS, slots=5), 2, tmp_path)
    with pytest.raises(RuntimeError, match="give the instance --max-total-tokens"):
        pp_movable.share_layers(fused_pool(2, LAYERS - 2, slots=6), 2, tmp_path)


def model(start: int = 0) -> types.SimpleNamespace:
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(LAYERS))
    return types.SimpleNamespace(layers=layers, start_layer=start)


LINEAR_BYTES = (4 * 4 + 4) * 4


@pytest.fixture
def control(tmp_path: Path) -> BoundaryControl:
    return BoundaryControl(tmp_path, create=True, boundary=6, num_layers=LAYERS)


def test_a_move_down_sends_the_layers_the_second_stage_lacks(
    control: BoundaryControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pp_movable, "chunked_prefill_in_flight", lambda: False)
    first, second = model(), model(start=2)
    sending, receiving = pp_movable.FirstStage(first, 2, control), pp_movable.LastStage(second, 6)
    assert all(second.layers[n].weight.numel() == 0 for n in range(2, 6))  # freed once loaded
    assert sending.next_boundary() == (6, {})  # nothing asked: nothing moves
    control.request(3)
    boundary, extra = sending.next_boundary()
    assert boundary == 3
    assert sorted(extra) == [f"banaserve.weight.{n}.{name}" for n in (3, 4, 5)
                             for name in ("bias", "weight")]  # fmt: skip
    assert control.read() == BoundaryState(3, 3, 1, 3 * LINEAR_BYTES, LAYERS)
    tensors = {"hidden_states": torch.ones(1), pp_movable.BOUNDARY_KEY: torch.tensor([3])}
    assert receiving.take({**tensors, **extra}) == 3
    for n in (3, 4, 5):
        assert torch.equal(second.layers[n].weight, first.layers[n].weight)
    control.request(LAYERS)
    boundary, extra = sending.next_boundary()
    assert (boundary, extra) == (LAYERS, {})  # up: nothing to send
    assert receiving.take({pp_movable.BOUNDARY_KEY: torch.tensor([LAYERS])}) == LAYERS
    assert all(second.layers[n].weight.numel() == 0 for n in range(2, LAYERS))  # holds none
    control.request(1)  # below the smallest boundary stage 1 has buffers for
    boundary, extra = sending.next_boundary()
    assert boundary == 2 and len(extra) == 2 * (LAYERS - 2)
    assert control.read().bytes_moved == (3 + LAYERS - 2) * LINEAR_BYTES


def test_the_second_stage_refuses_to_run_layers_it_has_no_weights_for(
    control: BoundaryControl,
) -> None:
    receiving = pp_movable.LastStage(model(start=2), 6)
    with pytest.raises(RuntimeError, match=r"no weights for layers \[4, 5\]"):
        receiving.take({pp_movable.BOUNDARY_KEY: torch.tensor([4])})
    assert receiving.take({}) == 6  # a warm-up's tensors carry no boundary: the current one


def test_a_move_up_waits_for_chunked_prefills(
    control: BoundaryControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up: after the last chunk too (the micro-batch after one with a chunked request)."""
    chunked = [True]
    monkeypatch.setattr(pp_movable, "chunked_prefill_in_flight", lambda: chunked[0])
    sending = pp_movable.FirstStage(model(), 2, control)
    control.request(LAYERS)
    assert sending.next_boundary()[0] == 6
    chunked[0] = False
    assert sending.next_boundary()[0] == 6  # the last chunk may still be on stage 1
    assert sending.next_boundary()[0] == LAYERS
    chunked[0] = True
    control.request(3)
    assert sending.next_boundary()[0] == 3  # down never waits


def test_patches_of_one_module_all_run_in_order() -> None:
    ran: list[str] = []
    patch = import_hook.chained([lambda m: ran.append("a"), lambda m: ran.append("b")])
    patch(types.ModuleType("m"))
    assert ran == ["a", "b"]
    assert "sglang.srt.models.llama" in import_hook.POST_IMPORT_PATCHES
