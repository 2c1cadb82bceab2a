"""Each rank of a multi-rank SGLang server on the CPU runs on the cores its
``SGLANG_CPU_OMP_THREADS_BIND`` entry names.

SGLang reads that variable (``utils/numa_utils.py`` ``init_threads_binding``) and hands each
rank its entry, but binds threads only with its AMX or arm64 kernels
(``distributed/bootstrap.py`` ``_init_cpu_threads_env``); elsewhere it logs that binding is
disabled, and both pipeline stages of ``--pp-size 2`` roam over every core of the server. A
layer split only relieves a busy core if its stages run on different ones, so here, where
SGLang does not bind, every thread of the rank's process is pinned to its entry's cores and
torch computes with one thread per core.

Pinning never widens what the process was given: the entry is intersected with the process's
affinity (the cluster pins whole instances with ``taskset``). It happens only when the user
or the launcher (:mod:`banaserve.config.pipeline_options`) set the variable explicitly; a
server that did not name cores keeps SGLang's behaviour.
"""

from __future__ import annotations

import functools
import logging
import os
import types
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("banaserve.platform")


def parse_cpu_list(spec: object) -> set[int]:
    """The cores of one ``SGLANG_CPU_OMP_THREADS_BIND`` entry (``"0,2-3"``) or a list of
    core ids. Raises ValueError on anything else."""
    if isinstance(spec, (list, tuple, set)):
        return {int(core) for core in spec}
    cores: set[int] = set()
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    if not cores:
        raise ValueError(f"no cores in {spec!r}")
    return cores


def pin_process(cores: set[int]) -> set[int]:
    """Pin every thread of this process to ``cores`` within its current affinity; the cores
    it runs on afterwards (unchanged when the two do not meet)."""
    allowed = os.sched_getaffinity(0)
    target = cores & allowed
    if not target:
        logger.warning("cores %s are outside this process's %s: not pinned", cores, allowed)
        return allowed
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), target)
        except (ProcessLookupError, PermissionError):  # the thread ended meanwhile
            continue
    return target


def binding_where_sglang_does_not(
    original: Callable[..., None], module: types.ModuleType
) -> Callable[..., None]:
    """``_init_cpu_threads_env`` that, where SGLang binds nothing, pins the rank's process."""

    @functools.wraps(original)
    def _init_cpu_threads_env(*args: Any, local_omp_cpuid: Any = None, **kwargs: Any) -> None:
        original(*args, local_omp_cpuid=local_omp_cpuid, **kwargs)
        # Imported here: this module loads in every Python process (the import hook).
        from banaserve.env import THREADS_BIND_ENV

        sglang_binds = getattr(module, "_is_cpu_amx_available", False) or getattr(
            module, "_is_cpu_arm64", False
        )
        if sglang_binds or not os.environ.get(THREADS_BIND_ENV) or local_omp_cpuid is None:
            return
        import torch

        cores = pin_process(parse_cpu_list(local_omp_cpuid))
        torch.set_num_threads(len(cores))
        logger.info("rank pinned to cores %s (%d torch threads)", sorted(cores), len(cores))

    _init_cpu_threads_env.__banaserve_patched__ = True  # type: ignore[attr-defined]
    return _init_cpu_threads_env


def patch_bootstrap(module: types.ModuleType) -> None:
    """Pin each rank's process in ``distributed/bootstrap.py`` where SGLang does not."""
    original = module._init_cpu_threads_env
    if not getattr(original, "__banaserve_patched__", False):
        module._init_cpu_threads_env = binding_where_sglang_does_not(original, module)


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.distributed.bootstrap": patch_bootstrap,
}
