"""What the cluster's children leave behind when they are killed: processes and /dev/shm files.

SGLang processes killed with SIGKILL (by PDEATHSIG, by ``kill_process_tree``, by the OOM
killer) never unlink their shared-memory files (``/dev/shm/sglang_loads_*``, multiprocessing
semaphores), and tmpfs is RAM. Their names carry no PID to attribute them by, so the
launcher looks at what its children actually map: :func:`mapped_shm_files` reads the
``/proc/PID/maps`` of every process in the children's sessions. :class:`LeftoverLedger`
keeps the union in a small JSON file, which the launcher (on a clean exit) or the reaper
(:mod:`banaserve.cluster.reaper`, when the launcher was killed) reads to kill what still runs
in those sessions and remove the files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = "/dev/shm/"


def session_members(sessions: Iterable[int]) -> list[int]:
    """PIDs of the live processes (zombies left out) whose session id is in ``sessions``."""
    wanted = set(sessions)
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp session ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) in wanted:
            members.append(int(entry.name))
    return members


def mapped_shm_files(pids: Iterable[int]) -> set[str]:
    """Paths under /dev/shm that any of ``pids`` maps or holds open."""
    paths: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                at = line.find(SHM_DIR)
                if at >= 0:
                    paths.add(line[at:].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target.startswith(SHM_DIR):
                        paths.add(target.removesuffix(" (deleted)"))
    return paths


class LeftoverLedger:
    """The children's sessions and the shm files seen mapped by them, kept in ``path``.

    Written by one owner (the launcher's supervisor); :func:`clean_up` may run in another
    process. The file is replaced atomically, so a reader never sees half of it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sessions: set[int] = set()
        self.shm: set[str] = set()

    def add_session(self, pid: int) -> None:
        self.sessions.add(pid)
        self._save()

    def scan(self) -> None:
        """Record the shm files the children's sessions map now (blocking: /proc reads)."""
        seen = mapped_shm_files(session_members(self.sessions))
        if not seen <= self.shm:
            self.shm |= seen
            self._save()

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"sessions": sorted(self.sessions), "shm": sorted(self.shm)}))
        os.replace(tmp, self.path)


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _kill(pids: Iterable[int]) -> int:
    killed = 0
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def clean_up(ledger_path: Path, wait_s: float = 8.0) -> tuple[int, int]:
    """Kill what still runs in the recorded sessions and remove the recorded shm files (a
    process that still maps one keeps its memory until it unmaps it; only the name goes).
    Returns (processes killed, files removed).

    Python's resource trackers are spared for up to ``wait_s``: once every process they
    served is gone, they unlink the semaphores and segments those registered (names no
    mapping reveals) and exit by themselves; what still runs after that is killed.
    """
    try:
        state = json.loads(ledger_path.read_text())
    except (OSError, ValueError):
        return 0, 0
    sessions = [int(s) for s in state.get("sessions", [])]
    killed = _kill(p for p in session_members(sessions) if not _is_resource_tracker(p))
    deadline = time.monotonic() + wait_s
    while session_members(sessions) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILL is asynchronous: a big process takes a while to unmap
    killed += _kill(session_members(sessions))
    removed = 0
    for path in state.get("shm", []):
        if path.startswith(SHM_DIR):
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(path)
                removed += 1
    return killed, removed
