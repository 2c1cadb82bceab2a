"""The SSD tier: one verified file per page, LRU-evicted by a byte capacity, restartable."""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from .base import PageStore, StoreStats
from .memory import check_key
from .pagefile import HEADER_BYTES, PageFormatError, encode_header, read_header, read_payload

logger = logging.getLogger(__name__)

_HEX = frozenset("0123456789abcdef")
_FileId = tuple[int, int]  # (st_dev, st_ino): tells a corrupt file from its fresh replacement


class SsdStore(PageStore):
    """Pages as files ``directory/<first 2 hex of key>/<64 hex of key>.page``.

    Each file is written to a unique ``*.tmp`` beside it and renamed into place, so a reader
    sees the old page or the new one, never a torn one. Every read verifies the header and the
    checksum (``pagefile``); a page that fails is deleted, counted in ``corrupt_dropped`` and
    reported as a miss. Capacity counts payload bytes (each file also has a 64-byte header);
    a ``put`` may briefly exceed it by the page files being written.

    Restart: opening a directory rebuilds the index from the files, checking each header
    against the name and the file size (``verify_on_open``; set False to open millions of
    pages faster, reads still verify), removes leftover ``*.tmp`` files, and restores LRU
    order from file mtimes, which the store sets from a strictly increasing clock on every
    write and hit. Files not named like pages are left alone. One store per directory: a
    second one (in any process) fails with RuntimeError on an advisory lock.

    Durability: with ``fsync=False`` (default) a page survives a process crash once ``put``
    returns, not a power loss; ``fsync=True`` syncs the file and its folder on every put.

    Locking: one lock guards the index and counters. Payload reads and writes happen outside
    it; under it run only metadata calls for one page (rename, utime, unlink) plus the unlinks
    of the pages that a put evicts. ``put`` blocks on disk I/O; ``get`` blocks on one read.
    """

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        *,
        fsync: bool = False,
        verify_on_open: bool = True,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"SSD capacity_bytes must be > 0, got {capacity_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> payload bytes, LRU first
        self._bytes = 0
        self._clock = 0  # last mtime handed out, ns
        self._tmp_names = itertools.count()
        self._subdirs: set[str] = set()
        self._closed = False
        self._hits = 0
        self._misses = 0
        self._puts = 0
        self._evicted = 0
        self._corrupt = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._acquire_dir_lock()
        try:
            self._scan(verify_on_open)
        except BaseException:
            os.close(self._lock_fd)
            raise

    # -- PageStore -------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes) -> bool:
        """Write the page durably (see class doc) and make it most recently used; evicts the
        least recently used pages beyond capacity. False if ``value`` exceeds the capacity.
        Raises OSError when the disk write fails (nothing changes then)."""
        check_key(key)
        if len(value) > self.capacity_bytes:
            return False
        if self._closed:
            raise RuntimeError("SsdStore is closed")
        path = self._path(key)
        self._ensure_subdir(path.parent)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{next(self._tmp_names)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(encode_header(key, value))
                f.write(value)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            with self._lock:
                tick = self._tick()
                os.utime(tmp, ns=(tick, tick))
                os.replace(tmp, path)
                self._account_put(key, len(value))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self._fsync:
            self._fsync_dir(path.parent)
        return True

    def get(self, key: bytes) -> bytes | None:
        """The verified page or None; a corrupt or vanished page is dropped (a miss)."""
        with self._lock:
            if key not in self._index:
                self._misses += 1
                return None
        path = self._path(key)
        file_id: _FileId | None = None
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                file_id = (st.st_dev, st.st_ino)
                payload = read_payload(f, key)
        except (PageFormatError, OSError) as exc:
            self._drop(key, path, file_id, exc)
            return None
        with self._lock:
            self._hits += 1
            if key not in self._index:  # evicted while we read: the bytes are still valid
                return payload
            self._index.move_to_end(key)
            tick = self._tick()
        try:
            # The mtime carries LRU order across restarts; losing one update only costs order.
            os.utime(path, ns=(tick, tick))
        except OSError:
            pass
        return payload

    def contains(self, key: bytes) -> bool:
        """Index lookup only: no disk access, so a corrupt page still counts until read."""
        with self._lock:
            return key in self._index

    def touch(self, key: bytes) -> bool:
        """Mark a page most recently used without disk I/O (used on hits served by a faster
        tier). The mtime is not updated, so a restart does not remember this use."""
        with self._lock:
            if key not in self._index:
                return False
            self._index.move_to_end(key)
            return True

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                ssd_pages=len(self._index),
                ssd_bytes=self._bytes,
                hits=self._hits,
                misses=self._misses,
                puts=self._puts,
                evicted_ssd=self._evicted,
                corrupt_dropped=self._corrupt,
            )

    def clear(self) -> int:
        return len(self.drop_all())

    def drop_all(self) -> list[bytes]:
        """Delete every page file; their keys. Unlinks under the lock, as eviction does, so
        that a put racing with this keeps its fresh file or loses it, never its index entry."""
        with self._lock:
            keys = list(self._index)
            self._index.clear()
            self._bytes = 0
            for key in keys:
                try:
                    self._path(key).unlink(missing_ok=True)
                except OSError as exc:
                    logger.warning("could not delete page %s: %s", key.hex(), exc)
        return keys

    def close(self) -> None:
        """Release the directory lock; pages stay on disk for the next store. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.close(self._lock_fd)

    # -- internals -------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.directory / name[:2] / f"{name}.page"

    def _ensure_subdir(self, subdir: Path) -> None:
        if subdir.name not in self._subdirs:
            subdir.mkdir(exist_ok=True)
            self._subdirs.add(subdir.name)

    def _tick(self) -> int:
        """A strictly increasing ns timestamp (caller holds the lock): coarse file-system
        clocks would otherwise give pages written in one burst the same mtime."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _account_put(self, key: bytes, size: int) -> None:
        """Index a page just renamed into place and evict beyond capacity (lock held)."""
        old = self._index.pop(key, None)
        if old is not None:
            self._bytes -= old
        self._index[key] = size
        self._bytes += size
        self._puts += 1
        self._evict_to_capacity()

    def _evict_to_capacity(self) -> None:
        # Unlinking under the lock keeps index and files in step: a concurrent put of the
        # victim's key cannot have its fresh file deleted by a late unlink.
        while self._bytes > self.capacity_bytes:
            victim, size = self._index.popitem(last=False)
            self._bytes -= size
            self._evicted += 1
            try:
                self._path(victim).unlink(missing_ok=True)
            except OSError as exc:
                logger.warning("could not delete evicted page %s: %s", victim.hex(), exc)

    def _drop(self, key: bytes, path: Path, file_id: _FileId | None, exc: BaseException) -> None:
        """Count a miss; delete the page if the file that failed is still the indexed one."""
        with self._lock:
            self._misses += 1
            if key not in self._index:
                return  # evicted or never there: a plain miss
            try:
                st = os.stat(path)
                current: _FileId | None = (st.st_dev, st.st_ino)
            except FileNotFoundError:
                current = None
            if file_id is not None and current is not None and current != file_id:
                return  # replaced by a fresh put while we read the old file
            size = self._index.pop(key)
            self._bytes -= size
            self._corrupt += 1
            try:
                path.unlink(missing_ok=True)
            except OSError as unlink_exc:
                logger.warning("could not delete corrupt page %s: %s", path, unlink_exc)
        logger.warning("dropped corrupt or missing page %s: %s", key.hex(), exc)

    def _scan(self, verify: bool) -> None:
        """Rebuild index and LRU order from the directory (constructor only: no lock)."""
        found: list[tuple[int, bytes, int]] = []  # (mtime_ns, key, payload bytes)
        for sub in os.scandir(self.directory):
            if not (sub.is_dir(follow_symlinks=False) and _is_hex(sub.name, 2)):
                continue
            self._subdirs.add(sub.name)
            for entry in os.scandir(sub.path):
                page = self._scan_entry(sub.name, entry, verify)
                if page is not None:
                    found.append(page)
        found.sort()
        for mtime_ns, key, size in found:
            self._index[key] = size
            self._bytes += size
            self._clock = max(self._clock, mtime_ns)
        self._evict_to_capacity()
        logger.info(
            "SSD store %s: %d pages, %d bytes, %d corrupt dropped, %d evicted on open",
            self.directory,
            len(self._index),
            self._bytes,
            self._corrupt,
            self._evicted,
        )

    def _scan_entry(
        self, subdir: str, entry: os.DirEntry[str], verify: bool
    ) -> tuple[int, bytes, int] | None:
        name = entry.name
        if name.endswith(".tmp"):
            # A put that died between write and rename; never visible to readers.
            Path(entry.path).unlink(missing_ok=True)
            return None
        stem = name.removesuffix(".page")
        if stem == name or not _is_hex(stem, 64) or not stem.startswith(subdir):
            return None
        key = bytes.fromhex(stem)
        try:
            st = entry.stat(follow_symlinks=False)
            if verify:
                with open(entry.path, "rb") as f:
                    size = read_header(f, key)
            elif st.st_size < HEADER_BYTES:
                raise PageFormatError("truncated header")
            else:
                size = st.st_size - HEADER_BYTES
        except (PageFormatError, OSError) as exc:
            logger.warning("dropping corrupt page file %s: %s", entry.path, exc)
            self._corrupt += 1
            Path(entry.path).unlink(missing_ok=True)
            return None
        return st.st_mtime_ns, key, size

    def _acquire_dir_lock(self) -> int:
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"{self.directory} is in use by another SsdStore") from None
        return fd

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _is_hex(name: str, length: int) -> bool:
    return len(name) == length and set(name) <= _HEX
