"""``python -m banaserve.launch_server`` as a process, without starting a server: unknown flags
and bad store flags fail with its usage, and ``--help`` lists SGLang's and BanaServe's flags.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_unknown_flag_fails_with_usage() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "banaserve.launch_server", "--model-path", "x", "--bogus-flag"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "usage: python -m banaserve.launch_server" in run.stderr
    assert "unrecognized arguments: --bogus-flag" in run.stderr


def test_help_lists_sglang_and_banaserve_flags() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "banaserve.launch_server", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0
    assert "--model-path" in run.stdout and "--kv-pool-memory-fraction" in run.stdout


def test_kv_store_flags_are_validated(tiny_model: Path) -> None:
    for bad, message in [
        (["--kv-store", "localhost:7000"], "is not a URL"),
        (["--kv-store", "tcp://a:1", "--kv-store-replication", "2"], "needs at least as many"),
        (["--kv-store", "tcp://a:1", "--kv-store-mode", "nfs"], "invalid choice"),
    ]:
        run = subprocess.run(
            [sys.executable, "-m", "banaserve.launch_server", "--model-path", str(tiny_model),
             *bad],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 2, run.stderr[-2000:]
        assert message in run.stderr


def test_pp_layer_boundary_is_validated_before_anything_starts(tiny_model: Path) -> None:
    for bad, message in [
        (["--pp-layer-boundary", "1"], "it needs --pp-size 2 (got --pp-size 1)"),
        (["--pp-size", "2", "--pp-layer-boundary", "2"], "the model has 2 layers, so it must be "
                                                          "between 1 and 1"),
    ]:  # fmt: skip
        run = subprocess.run(
            [sys.executable, "-m", "banaserve.launch_server", "--model-path", str(tiny_model),
             *bad],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 2, run.stderr[-2000:]
        last = run.stderr.splitlines()[-1]  # one line, after the usage text
        assert last.startswith("python -m banaserve.launch_server: error: --pp-layer-boundary")
        assert message in last
