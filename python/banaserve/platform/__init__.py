"""Running PyPI SGLang's CPU engine on a machine with no NVIDIA driver.

The platform is an import hook (see :mod:`banaserve.platform.import_hook`) that a ``.pth``
file installs in every Python process. Where CUDA is usable it does nothing.
"""

from banaserve.platform.detect import cpu_platform_wanted, nvidia_driver_present
from banaserve.platform.environment import CPU_ENV_DEFAULTS, apply_cpu_environment
from banaserve.platform.import_hook import install

__all__ = [
    "CPU_ENV_DEFAULTS",
    "apply_cpu_environment",
    "cpu_platform_wanted",
    "install",
    "nvidia_driver_present",
]
