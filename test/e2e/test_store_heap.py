"""The store process keeps the memory its freed pages held: refilling it costs no page faults."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

#: Pages of 12 KiB (a SmolLM2 layer segment), 64 MiB of them, filled, freed, filled again.
REFILL = """
import json, resource, sys
from banaserve.kvstore.server.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
source = memoryview(bytes(range(256)) * 48)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def fill():
    before = faults()
    pages = [bytes(source) for _ in range(64 * 1024 // 12)]
    return pages, faults() - before
pages, first = fill()
del pages
pages, again = fill()
print(json.dumps({"kept": kept, "first": first, "again": again}))
"""


def refill(mode: str) -> dict[str, int]:
    run = subprocess.run([sys.executable, "-c", REFILL, mode], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    return json.loads(run.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_pages_are_refilled_without_page_faults() -> None:
    default, kept = refill("default"), refill("keep")
    # glibc's default returns the freed heap top: the second fill faults like the first.
    assert default["again"] > default["first"] // 2, default
    assert kept["kept"], kept
    assert kept["again"] < kept["first"] // 20, kept
