"""The server's side of ``shm://``: copying GET replies into a connection's segment.

The server creates each segment and the client maps it (:mod:`banaserve.kvstore.segments`).
Page bytes cross through the segment, so a shm request makes the server allocate no payload
buffer.
"""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Any

from banaserve.kvstore.protocol import ProtocolError

#: Bytes a pipelined shm GET copies between updates of the progress word.
SHM_CHUNK_BYTES = 256 << 10


def progress_offset(value: Any, segment: shared_memory.SharedMemory) -> int | None:
    """A GET's ``progress`` field: None, or an 8-aligned offset of 8 bytes inside the segment."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"GET: 'progress' must be an int offset, got {value!r}")
    if value < 0 or value % 8 or value + 8 > segment.size:
        raise ProtocolError(
            f"GET: progress offset {value} not an aligned word of the {segment.size}-byte segment"
        )
    return value


def copy_pages(buf: memoryview, views: list[memoryview], word: memoryview | None = None) -> None:
    """Copy ``views`` back to back from offset 0 of ``buf``; with ``word``, store in it the
    bytes copied so far about every :data:`SHM_CHUNK_BYTES` and at the end."""
    offset = published = 0
    for view in views:
        size = view.nbytes
        if word is None or size <= SHM_CHUNK_BYTES:
            buf[offset : offset + size] = view
            offset += size
        else:
            for start in range(0, size, SHM_CHUNK_BYTES):
                piece = view[start : start + SHM_CHUNK_BYTES]
                buf[offset : offset + piece.nbytes] = piece
                offset += piece.nbytes
                word[0] = published = offset
            continue
        if word is not None and offset - published >= SHM_CHUNK_BYTES:
            word[0] = published = offset
    if word is not None and published != offset:
        word[0] = offset


def segment_of(segment: shared_memory.SharedMemory | None) -> shared_memory.SharedMemory:
    if segment is None:
        raise ProtocolError("request says shm but no shared-memory segment was announced")
    return segment
