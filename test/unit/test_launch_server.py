"""The launcher's plan and CPU defaults, in process, without starting a server.

``python -m banaserve.launch_server`` as a process (usage, help, flag checks) is
``e2e/test_launch_server_cli.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from banaserve.config.cli import CPU_DEFAULT_DTYPE
from banaserve.launch_server import plan_launch
from banaserve.server import kv_pool_sizing
from banaserve.server.memory_plan import weights_bytes


def test_cpu_defaults_added_and_user_flags_kept(tiny_model: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("BANASERVE_PLATFORM", "cpu")
    plan = plan_launch(["--model-path", str(tiny_model), "--port", "1234"])
    argv = plan.sglang_argv
    assert argv[:4] == ["--model-path", str(tiny_model), "--port", "1234"]
    assert argv[argv.index("--device") + 1] == "cpu"
    assert "--sleep-on-idle" in argv and "--enable-metrics" in argv
    # The gateway routes on /v1/loads: the snapshot is published after every decode step.
    assert argv[argv.index("--load-snapshot-publish-interval") + 1] == "1"
    tokens = int(argv[argv.index("--max-total-tokens") + 1])
    assert kv_pool_sizing.MIN_TOKENS <= tokens <= kv_pool_sizing.MAX_TOKENS
    assert argv[argv.index("--served-model-name") + 1] == tiny_model.name

    plan = plan_launch(
        ["--model-path", str(tiny_model), "--device", "cpu", "--max-total-tokens", "999",
         "--served-model-name", "mine", "--kv-pool-memory-fraction", "0.5",
         "--load-snapshot-publish-interval", "7"]
    )  # fmt: skip
    argv = plan.sglang_argv
    assert argv.count("--device") == 1 and argv.count("--max-total-tokens") == 1
    assert argv.count("--load-snapshot-publish-interval") == 1  # the user's 7 is kept
    assert "--kv-pool-memory-fraction" not in argv  # BanaServe's own flags stay with us
    assert plan.served_names[0] == "mine"


def test_float32_by_default_on_the_cpu(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from banaserve.cluster import run

    monkeypatch.setenv("BANASERVE_PLATFORM", "cpu")
    model = tmp_path / "tiny-bf16"  # a checkpoint in bfloat16: what "auto" would run it in
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16",
                                                   "dtype": "bfloat16"}))  # fmt: skip
    per_token = kv_pool_sizing.kv_bytes_per_token(model, CPU_DEFAULT_DTYPE)
    assert CPU_DEFAULT_DTYPE == "float32"
    assert per_token == 2 * kv_pool_sizing.kv_bytes_per_token(model)  # "auto": bfloat16
    for module in (kv_pool_sizing, run):  # 20,000 float32 tokens in half of it
        monkeypatch.setattr(module, "available_memory_bytes", lambda: 40_000 * per_token)

    def flag(argv: list[str], name: str) -> str:
        assert argv.count(name) == 1, argv
        return argv[argv.index(name) + 1]

    base = ["--model-path", str(model), "--kv-pool-memory-fraction", "0.5"]
    plan = plan_launch(base)
    assert flag(plan.sglang_argv, "--dtype") == "float32"
    assert "dtype float32 (the CPU default; --dtype to change)" in plan.notes
    assert flag(plan.sglang_argv, "--max-total-tokens") == "20000"  # sized for float32
    plan = plan_launch([*base, "--dtype", "bfloat16"])
    assert flag(plan.sglang_argv, "--dtype") == "bfloat16"
    assert flag(plan.sglang_argv, "--max-total-tokens") == "40000"
    assert not any("dtype" in note for note in plan.notes)
    assert "--dtype" not in plan_launch([*base, "--no-cpu-defaults"]).sglang_argv
    # A cluster: each instance's own launcher adds it, and the memory plan sizes for it.
    cluster = [*base, "--num-prefill", "1", "--num-decode", "1", "--kv-store-capacity-gb", "1"]
    plan = plan_launch(cluster)
    assert "dtype float32 (the CPU default; --dtype to change)" in plan.notes
    assert plan.kv_store is not None
    instance = run.instance_launch_argv(cluster, plan.kv_store, ["shm://h:1"], str(model), 2, 0.5)
    argv = plan_launch(instance).sglang_argv
    assert flag(argv, "--dtype") == "float32"
    memory = run.memory_plan(plan.flags, plan.kv_store, str(model), 2)
    assert memory is not None
    assert memory.kv_pool_bytes == int(flag(argv, "--max-total-tokens")) * per_token
    assert memory.weights_bytes == weights_bytes(model, "float32") == 2 * weights_bytes(model)


def test_no_cpu_defaults_on_gpu(tiny_model: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("BANASERVE_PLATFORM", "cuda")
    argv = plan_launch(["--model-path", str(tiny_model)]).sglang_argv
    assert "--device" not in argv and "--sleep-on-idle" not in argv
    assert "--max-total-tokens" not in argv


def test_kv_pool_sized_from_memory(tiny_model: Path) -> None:
    per_token = kv_pool_sizing.kv_bytes_per_token(tiny_model)
    size = kv_pool_sizing.size_kv_pool(tiny_model, 0.1, available=per_token * 100_000)
    assert size.tokens == 10_000
    size = kv_pool_sizing.size_kv_pool(tiny_model, 0.1, available=per_token * 100)
    assert size.tokens == kv_pool_sizing.MIN_TOKENS
    size = kv_pool_sizing.size_kv_pool(tiny_model, 0.5, available=per_token * 10**9)
    assert size.tokens == kv_pool_sizing.MAX_TOKENS
    with pytest.raises(ValueError, match="fraction"):
        kv_pool_sizing.size_kv_pool(tiny_model, 1.5)


@pytest.mark.parametrize("mode", ["hicache", "linker"])
def test_kv_store_flags(tiny_model: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    from banaserve.launch_server import attach_kv_store

    monkeypatch.setenv("BANASERVE_KV_STORE_TOKEN", "secret")
    urls = "tcp://127.0.0.1:7001,tcp://127.0.0.1:7002"
    plan = plan_launch(
        ["--model-path", str(tiny_model), "--kv-store", urls, "--kv-store-replication", "2",
         "--kv-store-mode", mode]
    )  # fmt: skip
    argv = plan.sglang_argv
    assert argv[argv.index("--page-size") + 1] == "16"
    assert plan.kv_store is not None and plan.kv_store.mode == mode
    process, store_args = attach_kv_store(plan.kv_store)
    assert process is None  # nothing to start for external shards
    assert "secret" not in " ".join(store_args)  # the token travels in the environment
    if mode == "hicache":
        assert "--enable-hierarchical-cache" in store_args
        assert argv[argv.index("--hicache-storage-prefetch-policy") + 1] == "wait_complete"
        config_flag = "--hicache-storage-backend-extra-config"
    else:
        assert "--enable-unified-cache-external-linker" in store_args
        assert "--enable-hierarchical-cache" not in store_args + argv
        config_flag = "--unified-cache-external-linker-config"
    config = store_args[store_args.index(config_flag) + 1]
    assert "tcp://127.0.0.1:7001" in config and '"replication": 2' in config


def test_sglang_gets_argv_less_every_banaserve_flag(tiny_model: Path) -> None:
    """argv is parsed once: SGLang's share is argv less BanaServe's flags (read off the
    parser), values and switches alike, SGLang's flags kept in order."""
    from banaserve.config.cli import banaserve_flags

    ours = ["--num-prefill", "1", "--num-decode=1", "--cpu-affinity", "--kv-store", "none",
            "--kv-store-tenant", "t", "--max-request-n", "4", "--migration-predictive",
            "--migration", "layer"]  # fmt: skip
    sglang = ["--model-path", str(tiny_model), "--port", "1234", "--dtype", "float32"]
    plan = plan_launch([*ours[:6], *sglang[:4], *ours[6:], *sglang[4:]])
    assert plan.sglang_argv[:6] == sglang
    values, switches = banaserve_flags()
    assert not any(a.split("=", 1)[0] in values + switches for a in plan.sglang_argv)
    assert plan.cluster is not None and plan.cluster.cpu_affinity
    assert (plan.cluster.num_prefill, plan.cluster.num_decode) == (1, 1)
    assert plan.request_limits.max_n == 4 and plan.kv_store is None


def test_an_abbreviated_banaserve_flag_is_refused(tiny_model: Path, capsys) -> None:  # noqa: ANN001
    # argparse takes "--num-pre" for --num-prefill; SGLang's own parser would not.
    with pytest.raises(SystemExit) as exited:
        plan_launch(["--model-path", str(tiny_model), "--num-pre", "1"])
    assert exited.value.code == 2
    assert "give BanaServe's flags in full (--num-prefill)" in capsys.readouterr().err


def test_the_cluster_flags_are_the_cluster_groups() -> None:
    from banaserve.config.cli import CLUSTER_GROUP, banaserve_flags

    values, switches = banaserve_flags(CLUSTER_GROUP)
    assert {"--num-prefill", "--num-decode", "--router-policy", "--migration"} <= set(values)
    assert {"--cpu-affinity", "--migration-predictive"} <= set(switches)
    assert "--kv-store" not in values and "--kv-pool-memory-fraction" not in values


@pytest.mark.parametrize(
    ("flags", "spare"),
    [((), True), (("--serve-on-spare-prefill", "off"), False), (("--migration", "role"), True),
     (("--migration", "layer"), False)],
)  # fmt: skip
def test_long_requests_use_spare_prefill_cores_unless_layers_are_lent(
    tiny_model: Path, flags: tuple[str, ...], spare: bool
) -> None:
    # Under --migration layer the layer controller lends the prefill cores to decode work.
    argv = ["--model-path", str(tiny_model), "--num-prefill", "2", "--num-decode", "1", *flags]
    cluster = plan_launch(argv).cluster
    assert cluster is not None and cluster.serve_on_spare_prefill is spare
