"""Shared by the ucx:// tests: on a store process and on a listener in this process."""

from __future__ import annotations

import os

import numpy as np

TOKEN = "ucx-test-token"
PAGE = 64 << 10


def _pages(n: int, size: int = PAGE) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng()
    keys = [os.urandom(32) for _ in range(n)]
    return keys, [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
