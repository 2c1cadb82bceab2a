"""Patches that let SGLang's own pipeline parallelism (``--pp-size 2``) run on the CPU engine.

Applied by the import hook right after the named SGLang module executes, and only on the
CPU platform (where CUDA is usable nothing here runs):

- ``distributed.parallel_state``, ``init_model_parallel_group``: a group whose caller leaves
  ``use_pynccl`` unset gets pynccl unless the platform is NPU/XPU or out of tree, so the
  pipeline group (``initialize_model_parallel`` builds it so) tries to create a
  ``PyNcclCommunicator`` and fails with "Expected a cuda device, but got: cpu". On the CPU
  the unset default becomes ``False``: the group then sends and receives over its gloo
  ``cpu_group``, as every other CPU collective does. An explicit ``use_pynccl`` is kept.
  The module's own callers look the function up in its globals at call time, and no other
  SGLang module imports it by name, so replacing the module attribute reaches every caller.

What else PP needs on the CPU is the launcher's (see
:mod:`banaserve.config.pipeline_options`): ``SGLANG_CPU_OMP_THREADS_BIND`` with one entry per
rank, which SGLang's NUMA check demands as soon as there are more ranks than NUMA nodes.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any


def pynccl_off_by_default(original: Callable[..., Any]) -> Callable[..., Any]:
    """``init_model_parallel_group`` whose unset (None) ``use_pynccl`` means ``False``."""

    @functools.wraps(original)
    def init_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
        # use_pynccl is the fourth parameter (group_ranks, local_rank, backend, use_pynccl).
        if len(args) > 3:
            if args[3] is None:
                args = (*args[:3], False, *args[4:])
        elif kwargs.get("use_pynccl") is None:
            kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    init_model_parallel_group.__banaserve_patched__ = True  # type: ignore[attr-defined]
    return init_model_parallel_group


def patch_parallel_state(module: types.ModuleType) -> None:
    """Give ``distributed/parallel_state.py`` groups without pynccl unless asked for."""
    original = module.init_model_parallel_group
    if not getattr(original, "__banaserve_patched__", False):
        module.init_model_parallel_group = pynccl_off_by_default(original)


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.distributed.parallel_state": patch_parallel_state,
}
