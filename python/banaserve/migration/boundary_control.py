"""The movable layer boundary of one two-stage instance: what is asked for, what runs.

A split instance started with ``--pp-min-boundary`` (see
:mod:`banaserve.platform.pp_movable`) keeps a small record in its split folder, shared by
the processes of that instance: the server process (its ``/pp_boundary`` route) writes the
boundary asked for; the first pipeline stage reads it before each micro-batch, moves there,
and writes back the boundary it runs at and what the moves cost. The record is five int64
fields in one memory-mapped file, each written by one process only, so nothing is locked:
a reader sees each field either before or after a write, and the fields it reads together
(``applied``, ``moves``, ``bytes_moved``) come from the one writer.
"""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

#: Where the launcher puts split folders: memory, not disk (the KV of the shared layers).
SPLIT_ROOT = Path("/dev/shm")

_FIELDS = ("requested", "applied", "moves", "bytes_moved", "num_layers")
_FORMAT = "<" + "q" * len(_FIELDS)
_SIZE = struct.calcsize(_FORMAT)
_RECORD = "boundary"
_SPLIT_PREFIX = "banaserve-split-"


def checked_boundary(boundary: object, lowest: int, layers: int) -> int:
    """``boundary`` if it is an integer in [``lowest``, ``layers``]; ValueError saying what
    is wrong otherwise (the instance's route and the cluster's admin call both check so)."""
    if isinstance(boundary, bool) or not isinstance(boundary, int):
        raise ValueError(f"boundary must be an integer, got {boundary!r}")
    if not lowest <= boundary <= layers:
        raise ValueError(f"boundary {boundary} is out of range: this instance moves it between "
                         f"{lowest} and {layers}")  # fmt: skip
    return boundary


def make_private_dir(folder: Path) -> None:
    """Create ``folder`` (in a shared place: /dev/shm) readable by this user only; refuse one
    that exists and is not so (another user made it first, or it is a link)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} exists and is not a private folder of this user")


def split_dir_for(pid: int) -> Path:
    """The split folder of the instance whose launcher runs as ``pid``."""
    return SPLIT_ROOT / f"{_SPLIT_PREFIX}{pid}"


def remove_orphan_split_dirs(root: Path = SPLIT_ROOT) -> list[Path]:
    """Remove the split folders under ``root`` whose launcher no longer runs, and return them.

    A launcher removes its folder when it exits; one killed with SIGKILL (a cluster's stop
    that ran out of patience) cannot. The KV files in it are unlinked once both stages mapped
    them, so what stays is small (the record and two markers), but it piles up over runs.
    A folder whose PID was reused by another process stays until that one ends."""
    removed = []
    for folder in root.glob(f"{_SPLIT_PREFIX}*"):
        pid = folder.name.removeprefix(_SPLIT_PREFIX)
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@dataclass(frozen=True)
class BoundaryState:
    """One reading of the record. ``requested``: the boundary asked for; ``applied``: the one
    the last micro-batch ran at; ``moves`` and ``bytes_moved``: how many times it changed,
    and the layer weights sent to the second stage for it."""

    requested: int
    applied: int
    moves: int
    bytes_moved: int
    num_layers: int


class BoundaryControl:
    """The record in ``split_dir``, mapped into this process. ``create`` makes it (the
    launcher, once); every other process opens it. Reads and writes never block."""

    def __init__(self, split_dir: Path, *, create: bool = False, boundary: int = 0,
                 num_layers: int = 0) -> None:  # fmt: skip
        path = Path(split_dir) / _RECORD
        if create:
            make_private_dir(path.parent)
            path.write_bytes(struct.pack(_FORMAT, boundary, boundary, 0, 0, num_layers))
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)

    def read(self) -> BoundaryState:
        return BoundaryState(*struct.unpack_from(_FORMAT, self._map, 0))

    def request(self, boundary: int) -> None:
        """Ask for ``boundary`` (the server process). The first stage moves there before its
        next micro-batch; the caller checks the range."""
        self._write("requested", boundary)

    def record_applied(self, boundary: int, moves: int, bytes_moved: int) -> None:
        """What the first stage now runs at, and its totals (the first stage only)."""
        self._write("bytes_moved", bytes_moved)
        self._write("moves", moves)
        self._write("applied", boundary)

    def _write(self, field: str, value: int) -> None:
        struct.pack_into("<q", self._map, 8 * _FIELDS.index(field), value)
