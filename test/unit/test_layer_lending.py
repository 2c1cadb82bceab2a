"""``--migration layer``'s layout, without starting anything: which cores each decode
instance's two pipeline stages get, the flags and environment its launcher receives, the
checks before anything starts, and what ``/migration`` reports. The layout served end to end
is ``e2e/test_cluster_layer.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from banaserve.cluster.layer_layout import LayerLayout
from banaserve.cluster.processes import instance_argv, instance_env
from banaserve.cluster.topology import (
    DECODE,
    PREFILL,
    InstanceSpec,
    lend_decode_layers,
    plan_cores,
    plan_instances,
)
from banaserve.config.pipeline_options import LayerSplit, lending_split
from banaserve.env import THREADS_BIND_ENV
from banaserve.launch_server import plan_launch
from banaserve.router.load import InstanceLoad

SPLIT = LayerSplit(15, 30)
PP_FLAGS = ("--pp-size", "2", "--pp-layer-boundary", "15", "--pp-min-boundary", "1")


def pinned(prefill: int, decode: int) -> list[InstanceSpec]:
    cores = plan_cores(prefill + decode, [0, 1])
    return plan_instances(prefill, decode, list(range(9000, 9000 + prefill + decode)), cores)


def test_the_decode_instance_lends_its_later_layers_to_the_prefill_core_of_its_own() -> None:
    # 2P+1D on two cores: prefill-0 and decode-0 share core 0; prefill-1 has core 1 alone.
    specs = lend_decode_layers(pinned(2, 1), SPLIT)
    prefill_0, prefill_1, decode_0 = specs
    assert (prefill_0.cores, prefill_1.cores) == ((0,), (1,))
    assert (prefill_0.args, prefill_1.args, prefill_0.env) == ((), (), ())
    assert decode_0.cores == (0, 1) and decode_0.args == PP_FLAGS
    assert dict(decode_0.env) == {THREADS_BIND_ENV: "0|1"}  # stage 0 on its own core
    argv = instance_argv(decode_0, ["--model-path", "m"])
    assert argv[:3] == ["taskset", "-c", "0,1"] and argv[-6:] == list(PP_FLAGS)
    env = instance_env(decode_0, {"PATH": "/bin"})
    assert env[THREADS_BIND_ENV] == "0|1" and env["PATH"] == "/bin"
    layout = LayerLayout.of(specs, SPLIT)
    assert layout.stage_cores == {"decode-0": [[0], [1]]}
    assert (layout.to_json()["mode"], layout.boundary, layout.num_layers) == ("layer", 15, 30)
    assert layout.boundaries == layout.start == {"decode-0": 15}
    # Restarted, it runs whole on its own core.
    assert decode_0.unsplit == pinned(2, 1)[2] and decode_0.unsplit.unsplit is None


def test_stage_zero_stays_on_the_decode_instances_own_core() -> None:
    # 1P+1D: prefill-0 on core 0, decode-0 on core 1; stage 1 goes to core 0.
    decode_0 = lend_decode_layers(pinned(1, 1), SPLIT)[1]
    assert decode_0.cores == (1, 0) and dict(decode_0.env) == {THREADS_BIND_ENV: "1|0"}


def test_unpinned_decode_instances_only_become_two_stage() -> None:
    specs = [InstanceSpec("prefill-0", PREFILL, 1), InstanceSpec("decode-0", DECODE, 2)]
    decode_0 = lend_decode_layers(specs, SPLIT)[1]
    assert (decode_0.cores, decode_0.args, decode_0.env) == ((), PP_FLAGS, ())


def test_no_prefill_core_to_lend_is_a_clear_error() -> None:
    # 1P+2D on two cores: prefill-0 shares core 0 with decode-1.
    with pytest.raises(ValueError, match="decode-0 needs a prefill instance pinned to cores"):
        lend_decode_layers(pinned(1, 2), SPLIT)


def test_the_split_starts_whole_and_is_checked(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    assert lending_split(None, 1, tmp_path) == LayerSplit(30, 30)  # lends nothing at first
    assert lending_split(24, 1, tmp_path) == LayerSplit(24, 30)
    with pytest.raises(ValueError, match="drop --pp-size 2"):
        lending_split(None, 2, tmp_path)
    with pytest.raises(ValueError, match="must be between 1 and 30"):
        lending_split(31, 1, tmp_path)


def test_the_launcher_checks_layer_mode_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BANASERVE_PLATFORM", "cpu")
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 128, "torch_dtype": "float32"}))  # fmt: skip
    cluster = ["--model-path", str(tmp_path), "--num-prefill", "2", "--num-decode", "1",
               "--migration", "layer"]  # fmt: skip
    plan = plan_launch([*cluster, "--pp-layer-boundary", "3"])
    assert "decode instances start lending layers [3, 8)" in plan.notes
    assert plan.cluster is not None and plan.cluster.migration == "layer"
    whole = plan_launch(cluster)  # the default: start whole
    assert "decode instances start lending no layer until the controller finds it pays" in (
        whole.notes
    )
    assert not plan.cluster.migration_predictive
    assert plan_launch([*cluster, "--migration-predictive"]).cluster.migration_predictive  # type: ignore[union-attr]
    for bad, message in [(["--pp-size", "2"], "drop --pp-size 2"),
                         (["--migration", "role", "--migration-predictive"],
                          "it needs --migration layer"),
                         (["--pp-layer-boundary", "9"], "must be between 1 and 8")]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            plan_launch([*cluster, *bad])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_an_instance_that_died_comes_back_whole_on_its_own_cores(
    tmp_path: Path,
) -> None:
    from banaserve.cluster import processes as cluster_processes
    from banaserve.router.board import Board

    class Run:
        """A run that has ended (unit tests start no processes)."""

        def __init__(self, name: str, argv: list[str], log_path: Path,
                     env: dict[str, str] | None = None) -> None:  # fmt: skip
            self.name, self.argv, self.log_path, self.env = name, argv, log_path, env or {}
            self.stopped = False

        def alive(self) -> bool:
            return False

        def respawn(self, argv: list[str], env: dict[str, str]) -> Run:
            self.stopped = True
            return Run(self.name, argv, self.log_path, env)

    specs = lend_decode_layers(pinned(2, 1), SPLIT)
    prefill_0, prefill_1, split = specs
    board = Board(specs)
    processes = cluster_processes.ClusterProcesses(tmp_path)
    processes._launch_argv, processes._env = ["--model-path", "m"], {"PATH": "/bin"}
    ended = Run(split.name, ["old"], tmp_path / "decode-0.log")
    child = cluster_processes.Child(split.name, ended, split)  # type: ignore[arg-type]
    again = processes.respawn(child)
    assert ended.stopped and child.spec == split.unsplit and child.spec.cores == (0,)
    assert again.argv[:3] == ["taskset", "-c", "0"]
    assert "--pp-layer-boundary" not in again.argv and THREADS_BIND_ENV not in again.env
    assert again.log_path == ended.log_path
    # The board's core neighbours follow: prefill-1 has core 1 to itself again.
    loads = {url: InstanceLoad(url, spec.role, running_reqs=2) for url, spec in
             ((s.url, s) for s in specs)}  # fmt: skip
    board.loads.update(loads)
    before = {c.url: c.core_peer_reqs for c in board.candidates(PREFILL)}
    board.replace_spec(child.spec)
    after = {c.url: c.core_peer_reqs for c in board.candidates(PREFILL)}
    assert before == {prefill_0.url: 2, prefill_1.url: 2}
    assert after == {prefill_0.url: 2, prefill_1.url: 0}
    layout = LayerLayout.of(specs, SPLIT)
    layout.record_fallback(child.spec, at=12.0)
    assert layout.boundaries == {"decode-0": 30} and not layout.is_split("decode-0")
    assert layout.stage_cores == {"decode-0": [[0]]}
    assert layout.history[-1]["from"] == 15 and layout.history[-1]["to"] == 30
