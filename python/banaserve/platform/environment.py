"""Environment variables SGLang reads at import time to run its CPU engine.

Only defaults are set: a variable the user exported wins.
"""

from __future__ import annotations

import os

CPU_ENV_DEFAULTS: dict[str, str] = {
    # Without it SGLang takes the CUDA code paths and fails on `import vllm`.
    "SGLANG_USE_CPU_ENGINE": "1",
    # Models are local folders; a hub lookup would hang on a machine without a network.
    "HF_HUB_OFFLINE": "1",
    # Otherwise SGLang binds its internal sockets to the machine's external address.
    "SGLANG_HOST_IP": "127.0.0.1",
}


def apply_cpu_environment() -> dict[str, str]:
    """Set the CPU defaults that are not already set; return the ones that were set."""
    applied = {}
    for key, value in CPU_ENV_DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied
