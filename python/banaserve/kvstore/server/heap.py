"""The store process keeps the heap memory its pages freed, for the next pages (glibc only).

A PUT copies each page into a new buffer and an eviction or a clear frees it. glibc hands the
freed top of its heap back to the kernel (``M_TRIM_THRESHOLD``) and serves blocks over its
mmap threshold with fresh mappings, so a store that refills pays a minor page fault per 4 KiB
it writes. Under load these faults were most of the store's CPU: 96k faults and 2.7 s of
system time in one ``compare.py`` uniform run of 16 requests on a 1P+1D cluster, on two busy
cores (benchmark/RESULTS.md, session 29). Kept, the freed memory serves the next puts with no
fault; the store's resident size then stays at its high-water mark, which ``--capacity-gb``
bounds. Buffers of :data:`RETURNED_BYTES` or more (a large frame's payload) are still mapped
apart and returned when freed.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

#: ``mallopt`` parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Blocks this large or larger get a mapping of their own, returned to the kernel when freed:
#: a store page stays below it (a whole 16-token page of Llama-3-8B in bf16 is 2 MiB).
RETURNED_BYTES = 4 << 20
#: The largest trim threshold ``mallopt`` takes (an int): the heap's free top is kept below it.
KEEP_BYTES = 2**31 - 1


def keep_freed_memory() -> bool:
    """Set this process's allocator to keep freed heap memory; False where it cannot (a libc
    other than glibc), which changes nothing but speed."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    kept = bool(mallopt(M_MMAP_THRESHOLD, RETURNED_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    )
    if not kept:
        logger.info("mallopt refused: freed page memory goes back to the kernel")
    return kept
