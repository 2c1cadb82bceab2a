"""Whether this process can use CUDA, decided without importing torch.

The answer drives the CPU platform: it must be known when ``sglang`` is first imported, which
happens in every process SGLang spawns, so it has to be cheap and must not initialise CUDA
(a CUDA context created before a fork breaks the child).
"""

from __future__ import annotations

import ctypes
import functools
import os

from banaserve.env import PLATFORM_ENV


@functools.lru_cache(maxsize=1)
def nvidia_driver_present() -> bool:
    """True when the NVIDIA driver library loads: the same test sgl_kernel fails on."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cpu_platform_wanted() -> bool:
    """True when this process should run SGLang's CPU engine through BanaServe's platform."""
    choice = os.environ.get(PLATFORM_ENV, "auto").strip().lower()
    if choice == "cpu":
        return True
    if choice in ("cuda", "gpu", "off"):
        return False
    if choice != "auto":
        raise ValueError(f"{PLATFORM_ENV}={choice!r}: expected one of auto, cpu, cuda")
    return not nvidia_driver_present()
