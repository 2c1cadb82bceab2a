"""What the servers ask of their :class:`PageStore` per request (the TCP server runs these on
its store threads, the ucx:// listener on its own thread; the store is thread-safe)."""

from __future__ import annotations

from banaserve.kvstore.storage.base import PageStore


def contains_all(store: PageStore, keys: list[bytes]) -> list[bool]:
    return [store.contains(key) for key in keys]


def read_pages(
    store: PageStore, keys: list[bytes], lengths: list[int], byte_range: list[int] | None
) -> list[memoryview | None]:
    """The requested bytes of each page, or None if missing or not exactly ``lengths[i]``."""
    views: list[memoryview | None] = []
    for key, length in zip(keys, lengths, strict=True):
        page = store.get(key)
        if page is None:
            views.append(None)
            continue
        view = memoryview(page)
        if byte_range is not None:
            offset, size = byte_range
            view = view[offset : offset + size]
        views.append(view if view.nbytes == length else None)
    return views


def split_pages(source: memoryview, sizes: list[int]) -> list[bytes]:
    """A PUT payload's pages as immutable bytes, which the store keeps: the one copy a PUT
    pays. Keeps no view of ``source``."""
    values, offset = [], 0
    for size in sizes:
        values.append(bytes(source[offset : offset + size]))
        offset += size
    return values


def put_pages(store: PageStore, keys: list[bytes], values: list[bytes]) -> list[bool]:
    return [store.put(key, value) for key, value in zip(keys, values, strict=True)]
