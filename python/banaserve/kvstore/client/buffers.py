"""The client's buffer helpers: the caller's keys and buffers checked and seen as byte views,
and how a batch is split into frames. Pure: nothing here does I/O or keeps a reference to a
buffer."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any

from banaserve.kvstore.keys import KEY_BYTES
from banaserve.kvstore.protocol import MAX_KEYS_PER_FRAME


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    out = []
    for i, key in enumerate(keys):
        if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
            what = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else repr(key)[:40]
            raise ValueError(f"key {i} must be {KEY_BYTES} bytes, got {what}")
        out.append(bytes(key))
    return out


def check_range(byte_range: tuple[int, int]) -> tuple[int, int]:
    offset, length = byte_range
    if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length <= 0:
        raise ValueError(f"byte_range must be (offset >= 0, length > 0), got {byte_range!r}")
    return offset, length


def page_views(buffers: Sequence[Any], n: int, *, writable: bool) -> list[list[memoryview]]:
    """Each page's memory as byte views: one buffer, or a list/tuple of segments whose
    concatenation is the page (a page scattered over a layer-first host pool)."""
    if len(buffers) != n:
        raise ValueError(f"{len(buffers)} buffers for {n} keys")
    return [
        [byte_view(seg, writable=writable) for seg in buf]
        if isinstance(buf, (list, tuple))
        else [byte_view(buf, writable=writable)]
        for buf in buffers
    ]


def byte_view(buf: Any, *, writable: bool) -> memoryview:
    """A flat byte view of ``buf``'s memory (no copy). CPU torch tensors are viewed through
    numpy; anything else must support the buffer protocol and be C-contiguous."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"tensor buffers must be on the CPU, got {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("tensor buffers must be contiguous")
        # .numpy() refuses dtypes numpy lacks (bfloat16); a uint8 view of the memory does not.
        buf = buf.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"{type(buf).__name__} does not support the buffer protocol") from None
    if writable and view.readonly:
        raise ValueError(f"buffer of type {type(buf).__name__} is read-only")
    if not view.c_contiguous:
        raise ValueError(f"buffer of type {type(buf).__name__} is not C-contiguous")
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot view {type(buf).__name__} as bytes: {exc}") from None
    return view


def chunks(idx: list[int], sizes: Sequence[int], max_bytes: int) -> Iterator[list[int]]:
    """Split ``idx`` into frames of at most MAX_KEYS_PER_FRAME keys and ``max_bytes`` bytes."""
    chunk: list[int] = []
    total = 0
    for i in idx:
        if sizes[i] > max_bytes:
            raise ValueError(f"page of {sizes[i]} bytes over the server's {max_bytes}-byte limit")
        if chunk and (len(chunk) == MAX_KEYS_PER_FRAME or total + sizes[i] > max_bytes):
            yield chunk
            chunk, total = [], 0
        chunk.append(i)
        total += sizes[i]
    if chunk:
        yield chunk
