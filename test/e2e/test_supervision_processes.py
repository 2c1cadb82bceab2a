"""Supervision with real processes and without SGLang: children die with their parent, and
the reaper cleans up after a killed launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from banaserve.cluster.leftovers import LeftoverLedger, session_members
from banaserve.cluster.reaper import Reaper

PARENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from banaserve.utils.processes import ManagedProcess
    child = ManagedProcess("child", [sys.executable, "-c", "import time; time.sleep(600)"],
                           Path(sys.argv[1]))
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def test_children_die_when_their_parent_is_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "child.log")], stdout=subprocess.PIPE
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60  # the kernel ends it at once; only a broken run waits
    while session_members([child]):
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.05)


HOLDER = textwrap.dedent(
    """
    import mmap, os, sys, time
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)  # as SGLang's load snapshots
    os.ftruncate(fd, 4096)
    mapped = mmap.mmap(fd, 4096)
    print("ok", flush=True)
    time.sleep(600)
    """
)


def test_the_reaper_cleans_up_after_a_killed_launcher(tmp_path: Path) -> None:
    """Processes left in the recorded sessions are killed and the shm files they mapped are
    removed once the launcher's end of the reaper's pipe closes."""
    name = f"/dev/shm/banaserve-test-{os.getpid()}"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, name], stdout=subprocess.PIPE,
                              start_new_session=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"ok"
        ledger = LeftoverLedger(tmp_path / "children.json")
        ledger.add_session(holder.pid)
        ledger.scan()
        assert os.stat(name).st_ino in ledger.shm
        reaper = Reaper(ledger.path, tmp_path / "reaper.log")
        time.sleep(0.2)
        assert reaper.process.poll() is None  # waits while the launcher lives
        reaper.stop()  # what the kernel does to the pipe when the launcher dies
        assert holder.wait(timeout=10) == -signal.SIGKILL
        assert not Path(name).exists()
        assert "removed 1 shm files" in (tmp_path / "reaper.log").read_text()
    finally:
        holder.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
