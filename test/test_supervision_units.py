"""Supervision without SGLang: the restart policy, the poison-pill guard, children that die
with their parent, and the clean-up of what killed children leave behind."""

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
from banaserve.cluster.poison import PoisonGuard, Retry
from banaserve.cluster.reaper import Reaper
from banaserve.cluster.restart_policy import RestartPolicy
from banaserve.cluster.supervisor import crashed_by_itself


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_restarts_back_off_exponentially_and_are_capped_per_minute() -> None:
    policy = RestartPolicy(initial_backoff_s=1, max_backoff_s=8, max_per_minute=3)
    restarts: list[float] = []
    delays = []
    now = 0.0
    for _ in range(6):  # a crash loop: each run dies at once
        at = policy.restart_at(restarts, now)
        delays.append(at - now)
        restarts.append(at)
        now = at
    assert delays[:3] == [1, 2, 4]
    assert delays[3] > 8  # the fourth in a minute waits for the first to leave the minute
    for i in range(len(restarts)):  # never more than 3 in any 60 s
        assert sum(1 for t in restarts if restarts[i] <= t < restarts[i] + 60) <= 3
    # A child that ran calmly for a while starts again from the first delay.
    assert policy.backoff_s(restarts, restarts[-1] + 10_000) == 1


def test_a_request_is_retried_once_then_quarantined() -> None:
    clock = Clock()
    guard = PoisonGuard(clock, quarantine_s=60)
    assert guard.refusal("pill") is None
    # Its instance crashed by itself: back to that instance once it is restarted.
    assert guard.after_death("pill", crashed_by_itself=True) is Retry.SAME_INSTANCE
    assert guard.refusal("pill") is None
    assert guard.after_death("pill", crashed_by_itself=True) is Retry.QUARANTINE
    message = guard.refusal("pill")
    assert message is not None and "crashed 2 instances" in message and "60 s" in message
    assert guard.refusal("innocent") is None
    # Killed from outside (OOM, an operator): says nothing against the request.
    assert guard.after_death("innocent", crashed_by_itself=False) is Retry.ELSEWHERE
    clock.now += 61
    assert guard.refusal("pill") is None  # the quarantine ends
    assert (guard.quarantined, guard.refused) == (1, 1)


def test_sglang_crashes_are_told_from_kills() -> None:
    log = "Scheduler hit an exception: Traceback ... IndexError: index out of range\n"
    assert crashed_by_itself(-9, log)  # SGLang SIGKILLs its own tree after a crash
    assert crashed_by_itself(1, "")
    assert not crashed_by_itself(-9, "INFO: 127.0.0.1 POST /generate 200\n")


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
    deadline = time.monotonic() + 10
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
        assert name in ledger.shm
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
