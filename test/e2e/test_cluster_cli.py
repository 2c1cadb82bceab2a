"""``python -m banaserve.cluster`` as a process: bad flags exit with its usage, before anything
starts.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv", [["--num-prefill", "-1"], ["--num-prefill", "0"],
                                  ["--router-policy", "nearest"]])  # fmt: skip
def test_bad_cluster_flags_exit_with_usage(argv: list[str]) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "banaserve.launch_server", "--model-path", "/nonexistent",
         "--num-decode", "0", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "usage:" in run.stderr
