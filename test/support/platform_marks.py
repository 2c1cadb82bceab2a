"""Shared by the platform tests in this process and those in a fresh interpreter."""

from __future__ import annotations

import pytest

from banaserve.platform import detect

needs_no_driver = pytest.mark.skipif(
    detect.nvidia_driver_present(), reason="checks the CPU platform on a machine with no driver"
)
