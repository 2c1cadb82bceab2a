"""Pipeline parallelism as the launcher sets it up, without starting anything: the
``--pp-layer-boundary`` checks, the environment for SGLang's stages, and the platform's
``pp_cpu`` patch. The split served end to end is ``e2e/test_pp_split.py``."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from banaserve.config.pipeline_options import (
    LayerSplit,
    layer_split,
    model_num_layers,
    pipeline_env,
    threads_bind,
)
from banaserve.env import (
    LAYER_PARTITION_ENV,
    MOVABLE_ENV,
    REQUEST_WAIT_ENV,
    SPLIT_DIR_ENV,
    THREADS_BIND_ENV,
)
from banaserve.launch_server import plan_launch
from banaserve.platform import pp_cpu


def config_dir(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_boundary_splits_the_model_layers(tmp_path: Path) -> None:
    model = config_dir(tmp_path, {"num_hidden_layers": 8})
    assert model_num_layers(model) == 8
    split = layer_split(3, 2, model)
    assert split == LayerSplit(3, 8) and split.partition == "3,5"
    assert layer_split(1, 2, model).partition == "1,7"  # type: ignore[union-attr]
    assert layer_split(7, 2, model).partition == "7,1"  # type: ignore[union-attr]
    # A movable boundary may start at L: stage 1 idle until it moves down.
    assert layer_split(8, 2, model, movable=True) == LayerSplit(8, 8)
    with pytest.raises(ValueError, match="between 1 and 7"):
        layer_split(8, 2, model)
    assert layer_split(None, 2, model) is None  # SGLang's even split
    assert layer_split(None, 1, tmp_path / "missing") is None  # nothing read without the flag
    multimodal = config_dir(tmp_path, {"text_config": {"num_hidden_layers": 30}})
    assert model_num_layers(multimodal) == 30


@pytest.mark.parametrize(
    ("boundary", "pp_size", "message"),
    [
        (3, 1, "--pp-layer-boundary splits a two-stage pipeline: it needs --pp-size 2 (got "
               "--pp-size 1)"),
        (3, 4, "it needs --pp-size 2 (got --pp-size 4)"),
        (0, 2, "--pp-layer-boundary 0 is out of range: the model has 8 layers, so it must be "
               "between 1 and 7"),
        (8, 2, "--pp-layer-boundary 8 is out of range"),
        (-1, 2, "must be between 1 and 7"),
    ],
)  # fmt: skip
def test_a_bad_boundary_is_one_clear_line(
    tmp_path: Path, boundary: int, pp_size: int, message: str
) -> None:
    model = config_dir(tmp_path, {"num_hidden_layers": 8})
    with pytest.raises(ValueError) as error:
        layer_split(boundary, pp_size, model)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_model_without_a_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read num_hidden_layers from .*config.json"):
        layer_split(3, 2, tmp_path)
    with pytest.raises(ValueError, match="KeyError"):
        layer_split(3, 2, config_dir(tmp_path, {"hidden_size": 8}))


def test_threads_bind_shares_the_cores_one_entry_per_rank() -> None:
    assert threads_bind(2, [0, 1]) == "0|1"
    assert threads_bind(2, [1, 0]) == "0|1"
    assert threads_bind(2, [4, 5, 6, 7]) == "4,5|6,7"
    assert threads_bind(2, [0, 1, 2]) == "0,1|2"
    assert threads_bind(2, [3]) == "3|3"  # one pinned core: both stages on it
    assert threads_bind(4, [0, 1]) == "0|1|0|1"
    assert threads_bind(1, [0, 1]) == "0,1"
    with pytest.raises(ValueError):
        threads_bind(2, [])


def test_pipeline_env_leaves_what_the_user_set() -> None:
    split = LayerSplit(3, 8)
    assert pipeline_env(split, 2, [0, 1], {}, cpu=True) == {
        LAYER_PARTITION_ENV: "3,5",
        THREADS_BIND_ENV: "0|1",
    }
    assert pipeline_env(split, 2, [0, 1], {}, cpu=False) == {LAYER_PARTITION_ENV: "3,5"}
    assert pipeline_env(None, 2, [0, 1], {}, cpu=True) == {THREADS_BIND_ENV: "0|1"}
    assert pipeline_env(None, 1, [0, 1], {}, cpu=True) == {}  # one rank: SGLang's own default
    user = {THREADS_BIND_ENV: "0-15|16-31", LAYER_PARTITION_ENV: "3, 5"}
    assert pipeline_env(split, 2, [0, 1], user, cpu=True) == {}
    with pytest.raises(ValueError, match=r"means SGLANG_PP_LAYER_PARTITION=3,5, but the "):
        pipeline_env(split, 2, [0, 1], {LAYER_PARTITION_ENV: "4,4"}, cpu=True)


def test_the_launcher_plans_the_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BANASERVE_PLATFORM", "cpu")
    monkeypatch.delenv(LAYER_PARTITION_ENV, raising=False)
    monkeypatch.delenv(THREADS_BIND_ENV, raising=False)
    monkeypatch.setenv(REQUEST_WAIT_ENV, "4")  # the user's own: kept, not added to the plan
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    model = config_dir(
        tmp_path,
        {"num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 128, "torch_dtype": "float32"},
    )  # fmt: skip
    base = ["--model-path", str(model), "--pp-size", "2"]
    plan = plan_launch([*base, "--pp-layer-boundary", "3"])
    assert plan.env == {LAYER_PARTITION_ENV: "3,5", THREADS_BIND_ENV: "0|1"}
    assert "--pp-layer-boundary" not in plan.sglang_argv  # BanaServe's own flag
    assert "pipeline: stage 0 runs layers [0, 3), stage 1 [3, 8)" in plan.notes
    assert plan_launch(base).env == {THREADS_BIND_ENV: "0|1"}
    assert plan_launch(["--model-path", str(model)]).env == {}
    # A cluster checks the flag; each instance's launcher sets its own environment.
    cluster = [*base, "--num-prefill", "1", "--num-decode", "1"]
    assert plan_launch([*cluster, "--pp-layer-boundary", "3"]).env == {}
    with pytest.raises(SystemExit):
        plan_launch([*cluster, "--pp-layer-boundary", "9"])
    # Unset, a server looks every second whether a waiting request's client left.
    monkeypatch.delenv(REQUEST_WAIT_ENV)
    assert plan_launch(["--model-path", str(model)]).env == {REQUEST_WAIT_ENV: "1"}
    assert "must be between 1 and 7" in capsys.readouterr().err
    # A movable boundary (--pp-min-boundary): the stages' variables and the route's note.
    movable = plan_launch([*base, "--pp-layer-boundary", "6", "--pp-min-boundary", "2"])
    assert movable.env[MOVABLE_ENV] == "2" and movable.env[LAYER_PARTITION_ENV] == "6,2"
    assert movable.env[SPLIT_DIR_ENV].startswith("/dev/shm/banaserve-split-")
    assert "--pp-min-boundary" not in movable.sglang_argv
    assert "the boundary moves between 2 and 8 (GET and POST /pp_boundary)" in movable.notes
    with pytest.raises(SystemExit):
        plan_launch([*base, "--pp-layer-boundary", "6", "--pp-min-boundary", "7"])
    assert "must be between 1 and --pp-layer-boundary (6)" in capsys.readouterr().err
    for bad, message in [
        (["--pp-layer-boundary", "3"], "needs --pp-size 2 (got --pp-size 1)"),
        ([*base[2:], "--pp-layer-boundary", "8"], "must be between 1 and 7"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            plan_launch(["--model-path", str(model), *bad])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_pipeline_groups_get_no_pynccl_unless_asked() -> None:
    calls: list[tuple[tuple, dict]] = []

    def init_model_parallel_group(*args: object, **kwargs: object) -> str:
        calls.append((args, kwargs))
        return "group"

    module = types.SimpleNamespace(init_model_parallel_group=init_model_parallel_group)
    pp_cpu.patch_parallel_state(module)  # type: ignore[arg-type]
    pp_cpu.patch_parallel_state(module)  # type: ignore[arg-type]  # idempotent: wrapped once
    patched = module.init_model_parallel_group
    assert patched([[0, 1]], 0, "gloo", group_name="pp") == "group"
    assert calls[-1] == (([[0, 1]], 0, "gloo"), {"group_name": "pp", "use_pynccl": False})
    patched([[0, 1]], 0, "gloo", use_pynccl=None)
    assert calls[-1][1] == {"use_pynccl": False}
    patched([[0, 1]], 0, "gloo", None, True)
    assert calls[-1] == (([[0, 1]], 0, "gloo", False, True), {})
    patched([[0, 1]], 0, "gloo", use_pynccl=True)  # an explicit choice is the caller's
    assert calls[-1][1] == {"use_pynccl": True}
    assert patched.__wrapped__ is init_model_parallel_group  # type: ignore[attr-defined]
