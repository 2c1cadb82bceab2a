"""The private rendezvous of a server's ranks (:mod:`banaserve.server.rendezvous`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from banaserve.env import RENDEZVOUS_ENV
from banaserve.server.rendezvous import needs_private_rendezvous, remove_dead_runs


def test_only_a_one_host_server_without_a_chosen_rendezvous_gets_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(RENDEZVOUS_ENV, raising=False)
    assert needs_private_rendezvous(1, None)
    assert not needs_private_rendezvous(2, None)
    assert not needs_private_rendezvous(1, "10.0.0.1:5000")
    monkeypatch.setenv(RENDEZVOUS_ENV, "tcp://10.0.0.1:5000")
    assert not needs_private_rendezvous(1, None)


def test_folders_of_runs_that_are_gone_are_removed_and_no_other(tmp_path: Path) -> None:
    # No process ever has a PID above the kernel's limit.
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    dead = tmp_path / f"banaserve-rendezvous-{gone}-abc"
    live = tmp_path / "banaserve-rendezvous-1-abc"  # init runs as long as the machine
    odd = tmp_path / "banaserve-rendezvous-x-abc"
    for folder in (dead, live, odd):
        folder.mkdir()
        (folder / "store").write_text("rank data")
    assert remove_dead_runs(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and odd.exists()
