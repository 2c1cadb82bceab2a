"""The shared-memory segments of ``shm://``: the store server creates and names each one, the
client maps it by that name and removes the name.

The server names them (issue 31): when the client named the segment, a tenant could make the
server map any file under /dev/shm, read it into its pages and overwrite it with a GET. A
name the server made is a new file of its own, random, in one recognisable form that the
client checks before it maps anything. Once both sides map a segment its name is removed, so
the memory goes back to the kernel when both are gone, even if one is killed.

Neither side leaves a segment to ``multiprocessing``'s resource tracker: the processes of one
cluster share a tracker, which counts a name that the server and a client both register once,
and printed a ``KeyError`` traceback at the second unregister, in every cluster's logs at
shutdown. The names live one round trip; one a killed process leaves, the cluster's reaper
removes (:mod:`banaserve.cluster.leftovers`).
"""

from __future__ import annotations

import _posixshmem  # the call SharedMemory.unlink makes, without its unregister
import contextlib
import os
import re
import secrets
import sys
from multiprocessing import resource_tracker, shared_memory

from banaserve.kvstore.protocol import ErrorCode, ProtocolError

#: Every segment's name: the prefix and 32 random hex digits.
_NAME = re.compile(r"bkv_[0-9a-f]{32}")


def create_segment(size: int) -> shared_memory.SharedMemory:
    """A new segment of ``size`` bytes with a fresh random name and its memory reserved.

    Reserving up front (posix_fallocate) turns a full /dev/shm into an OSError here, instead
    of a SIGBUS on first touch that would kill the process that touches it.
    """
    segment = _untracked(f"bkv_{secrets.token_hex(16)}", create=True, size=size)
    fd = getattr(segment, "_fd", -1)
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            destroy_segment(segment)
            raise OSError(
                exc.errno, f"cannot reserve {size} bytes of shared memory (/dev/shm full?)"
            ) from exc
    return segment


def open_segment(name: object, size: object) -> shared_memory.SharedMemory:
    """Map the server's segment ``name`` of ``size`` bytes and remove its name; ProtocolError
    (SHM) when the name is not one a server makes, the segment is missing (the server is on
    another host) or its size differs."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ProtocolError(
            f"the store named a segment {name!r}, not one it creates", ErrorCode.SHM
        )
    try:
        segment = _untracked(name)
    except FileNotFoundError:
        raise ProtocolError(
            f"shared-memory segment {name!r} not found: shm:// needs the store server on the "
            "same host as the client (use tcp:// across hosts)",
            ErrorCode.SHM,
        ) from None
    except OSError as exc:
        raise ProtocolError(
            f"cannot map shared-memory segment {name!r}: {exc}", ErrorCode.SHM
        ) from None
    unlink_name(segment)
    if not isinstance(size, int) or segment.size < size:
        destroy_segment(segment)
        raise ProtocolError(
            f"segment {name!r} is smaller than the {size} bytes announced", ErrorCode.SHM
        )
    return segment


def unlink_name(segment: shared_memory.SharedMemory) -> None:
    """Remove the segment's name from /dev/shm if it is still there; mappings stay valid."""
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink(segment._name)  # type: ignore[attr-defined]


def _untracked(name: str, create: bool = False, size: int = 0) -> shared_memory.SharedMemory:
    """``SharedMemory(name, create, size)`` that the resource tracker does not know of."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, create=create, size=size, track=False)
    segment = shared_memory.SharedMemory(name, create=create, size=size)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def destroy_segment(segment: shared_memory.SharedMemory) -> None:
    """Unmap and unlink; never raises (a lingering view only delays the unmap to GC)."""
    try:
        segment.close()
    except BufferError:
        pass
    unlink_name(segment)
