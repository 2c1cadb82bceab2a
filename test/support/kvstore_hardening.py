"""Shared by the store hardening tests: hostile clients on a store process, and in-process."""

from __future__ import annotations

import store_hostile as hostile

TOKEN = "hardening-token-0123456789"
MiB = 1 << 20
CAPACITY = int(hostile.CAPACITY_GB * (1 << 30))
