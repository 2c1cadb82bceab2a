"""What the cluster's children leave behind when they are killed: processes and /dev/shm files.

SGLang processes killed with SIGKILL (by PDEATHSIG, by ``kill_process_tree``, by the OOM
killer) never unlink their shared-memory files (``/dev/shm/sglang_loads_*``, multiprocessing
semaphores), and tmpfs is RAM. Their names carry no PID to attribute them by, so the
launcher looks at what its children actually map: :func:`mapped_shm` reads the
``/proc/PID/maps`` of every process in the children's sessions. :class:`LeftoverLedger`
keeps what each session mapped in a small JSON file: the supervisor releases a session when
its child dies (before the restart), and the launcher (on a clean exit) or the reaper
(:mod:`banaserve.cluster.reaper`, when the launcher was killed) reads it to kill what still
runs in the sessions and remove the files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from banaserve.server.rendezvous import remove_dead_runs

SHM_DIR = "/dev/shm/"


def members_by_session(sessions: Iterable[int]) -> dict[int, list[int]]:
    """PIDs of the live processes (zombies left out) in each of ``sessions``, in one pass."""
    members: dict[int, list[int]] = {session: [] for session in sessions}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp session ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) in members:
            members[int(fields[3])].append(int(entry.name))
    return members


def session_members(sessions: Iterable[int]) -> list[int]:
    """PIDs of the live processes (zombies left out) whose session id is in ``sessions``."""
    return [pid for members in members_by_session(sessions).values() for pid in members]


def mapped_shm(pids: Iterable[int]) -> set[int]:
    """Inodes of the files under /dev/shm that any of ``pids`` maps or holds open.

    Inodes, not names: glibc's ``sem_open`` maps a temporary name and links it to the
    semaphore's (``sem.mp-*``), so a mapping shows a name that no longer exists."""
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(SHM_DIR):
                    inodes.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path).startswith(SHM_DIR):
                        inodes.add(os.stat(fd.path).st_ino)
    return inodes


def shm_files(inodes: set[int]) -> list[str]:
    """Paths under /dev/shm of the files whose inode is in ``inodes``."""
    with contextlib.suppress(OSError), os.scandir(SHM_DIR) as entries:
        return [e.path for e in entries if e.inode() in inodes]
    return []


def recorded_shm(ledger_path: Path) -> set[int]:
    """The inodes a ledger file records, of every session (empty if it cannot be read)."""
    try:
        sessions = json.loads(ledger_path.read_text()).get("sessions", {})
    except (OSError, ValueError):
        return set()
    return {int(inode) for inodes in sessions.values() for inode in inodes}


def remove_shm(inodes: set[int]) -> int:
    """Unlink this user's files under /dev/shm whose inode is in ``inodes``; how many (a
    process that still maps one keeps its memory until it unmaps it; only the name goes)."""
    removed = 0
    with contextlib.suppress(OSError), os.scandir(SHM_DIR) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if info.st_ino in inodes and info.st_uid == os.getuid() and entry.is_file():
                    os.unlink(entry.path)
                    removed += 1
    return removed


class LeftoverLedger:
    """The children's sessions and the inodes of the shm files each was seen mapping, kept
    in ``path``.

    Written by one owner (the launcher's supervisor, from its loop and a worker thread: a
    lock serialises them); :func:`clean_up` may run in another process. The file is replaced
    atomically, so a reader never sees half of it. Blocking: every method but
    :meth:`add_session` reads /proc.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sessions: dict[int, set[int]] = {}
        self._lock = threading.Lock()

    @property
    def shm(self) -> set[int]:
        return set().union(*self.sessions.values())

    def add_session(self, pid: int) -> None:
        with self._lock:
            self.sessions[pid] = set()
            self._save()

    def scan(self) -> None:
        """Record the shm files each session maps now."""
        with self._lock:
            changed = False
            members = members_by_session(self.sessions)
            for session, known in self.sessions.items():
                seen = mapped_shm(members[session])
                if not seen <= known:
                    known |= seen
                    changed = True
            if changed:
                self._save()

    def release(self, session: int) -> tuple[int, int]:
        """A child whose session leader died: kill what still runs in its session, remove
        the shm files it mapped that no other session maps, and forget it. Returns
        (processes killed, files removed)."""
        with self._lock:
            killed = _kill(session_members([session]))
            theirs = self.sessions.pop(session, set())
            others = mapped_shm(session_members(self.sessions))
            self._save()
            return killed, remove_shm(theirs - others)

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        state = {str(session): sorted(inodes) for session, inodes in self.sessions.items()}
        tmp.write_text(json.dumps({"sessions": state}))
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
        sessions = [int(s) for s in json.loads(ledger_path.read_text()).get("sessions", {})]
    except (OSError, ValueError):
        return 0, 0
    killed = _kill(p for p in session_members(sessions) if not _is_resource_tracker(p))
    deadline = time.monotonic() + wait_s
    while session_members(sessions) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILL is asynchronous: a big process takes a while to unmap
    killed += _kill(session_members(sessions))
    remove_dead_runs(Path(tempfile.gettempdir()))  # the killed instances' rendezvous folders
    return killed, remove_shm(recorded_shm(ledger_path))
