"""The on-disk format of one page file: a 64-byte header, then the payload.

Header (little-endian): magic ``BNKVPAGE``, format version (u16), checksum algorithm (u16),
the page key (32 bytes), payload length (u64), checksum (u64), 4 reserved zero bytes. The
checksum covers the header fields before it *and* the payload, so a flipped bit anywhere but
the reserved bytes is caught: in magic/version/key/length by the field checks, elsewhere by
the checksum. The algorithm is xxh3-64 when ``xxhash`` is importable, else zlib's CRC-32; a
file written with an algorithm this process lacks cannot be verified and counts as corrupt.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import BinaryIO

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is installed where we test
    xxhash = None

MAGIC = b"BNKVPAGE"
VERSION = 1
ALGO_XXH3_64 = 1
ALGO_CRC32 = 2
DEFAULT_ALGO = ALGO_XXH3_64 if xxhash is not None else ALGO_CRC32

HEADER = struct.Struct("<8sHH32sQQ4x")
_PREFIX = struct.Struct("<8sHH32sQ")  # the header fields that the checksum covers
HEADER_BYTES = HEADER.size
assert HEADER_BYTES == 64


class PageFormatError(Exception):
    """The file is not a valid page for the expected key; the caller drops it."""


def checksum(algo: int, prefix: bytes, payload: bytes) -> int:
    """The checksum of ``prefix + payload`` without concatenating them (pages are large)."""
    if algo == ALGO_XXH3_64 and xxhash is not None:
        h = xxhash.xxh3_64(prefix)
        h.update(payload)
        return h.intdigest()
    if algo == ALGO_CRC32:
        return zlib.crc32(payload, zlib.crc32(prefix))
    raise PageFormatError(f"unknown or unavailable checksum algorithm {algo}")


def encode_header(key: bytes, payload: bytes, algo: int = DEFAULT_ALGO) -> bytes:
    """The header to write before ``payload``."""
    prefix = _PREFIX.pack(MAGIC, VERSION, algo, key, len(payload))
    return HEADER.pack(MAGIC, VERSION, algo, key, len(payload), checksum(algo, prefix, payload))


def check_header(header: bytes, key: bytes, file_size: int) -> tuple[int, int, int]:
    """Validate a header against the expected key and the file's size (no payload read).

    Returns ``(algo, payload_length, checksum)``; raises PageFormatError."""
    if len(header) < HEADER_BYTES:
        raise PageFormatError("truncated header")
    magic, version, algo, file_key, length, digest = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise PageFormatError("bad magic")
    if version != VERSION:
        raise PageFormatError(f"unsupported format version {version}")
    if file_key != key:
        raise PageFormatError("key in header does not match the file name")
    if HEADER_BYTES + length != file_size:
        raise PageFormatError(f"length {length} does not match file size {file_size}")
    return algo, length, digest


def read_header(f: BinaryIO, key: bytes) -> int:
    """Check the header of an open page file; returns the payload length."""
    _, length, _ = check_header(f.read(HEADER_BYTES), key, os.fstat(f.fileno()).st_size)
    return length


def read_payload(f: BinaryIO, key: bytes) -> bytes:
    """Read and verify a whole page from an open file positioned at 0; returns the payload."""
    header = f.read(HEADER_BYTES)
    algo, length, digest = check_header(header, key, os.fstat(f.fileno()).st_size)
    payload = f.read(length)
    if len(payload) != length:
        raise PageFormatError("truncated payload")
    if checksum(algo, header[: _PREFIX.size], payload) != digest:
        raise PageFormatError("checksum mismatch")
    return payload
