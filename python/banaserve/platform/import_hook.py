"""An import hook that applies the CPU platform in every process that imports SGLang.

It is installed by ``banaserve_platform.pth`` at interpreter start, so it reaches the
scheduler and detokenizer processes SGLang spawns without editing SGLang's files. It costs
one set lookup per import, and does nothing at all where CUDA is usable. Besides
``sgl_kernel`` (see :mod:`banaserve.platform.sgl_kernel_fallback`) it patches a few SGLang
modules right after they execute (see :mod:`banaserve.platform.hicache_cpu`,
:mod:`banaserve.platform.pd_cpu`, :mod:`banaserve.platform.pp_cpu`,
:mod:`banaserve.platform.pp_tied_head`, :mod:`banaserve.platform.sdpa_cpu`,
:mod:`banaserve.platform.stage_pinning` and, for tests only,
:mod:`banaserve.platform.fault_injection`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence

from banaserve.platform.attention_offload_cpu import POST_IMPORT_PATCHES as _OFFLOAD_PATCHES
from banaserve.platform.detect import cpu_platform_wanted
from banaserve.platform.environment import apply_cpu_environment
from banaserve.platform.fault_injection import POST_IMPORT_PATCHES as _FAULT_PATCHES
from banaserve.platform.hicache_cpu import POST_IMPORT_PATCHES as _HICACHE_PATCHES
from banaserve.platform.pd_cpu import POST_IMPORT_PATCHES as _PD_PATCHES
from banaserve.platform.pp_cpu import POST_IMPORT_PATCHES as _PP_PATCHES
from banaserve.platform.pp_movable import POST_IMPORT_PATCHES as _MOVABLE_PATCHES
from banaserve.platform.pp_tied_head import POST_IMPORT_PATCHES as _TIED_HEAD_PATCHES
from banaserve.platform.sdpa_cpu import POST_IMPORT_PATCHES as _SDPA_PATCHES
from banaserve.platform.stage_pinning import POST_IMPORT_PATCHES as _PINNING_PATCHES

_ALL_PATCHES = (
    _HICACHE_PATCHES, _PD_PATCHES, _PP_PATCHES, _TIED_HEAD_PATCHES, _MOVABLE_PATCHES,
    _SDPA_PATCHES, _PINNING_PATCHES, _FAULT_PATCHES, _OFFLOAD_PATCHES,
)  # fmt: skip


def chained(
    patches: Sequence[Callable[[types.ModuleType], None]],
) -> Callable[[types.ModuleType], None]:
    """One patch running ``patches`` in order (several concerns patch one module)."""
    if len(patches) == 1:
        return patches[0]

    def patch(module: types.ModuleType) -> None:
        for each in patches:
            each(module)

    return patch


_BY_MODULE: dict[str, list[Callable[[types.ModuleType], None]]] = {}
for _patches in _ALL_PATCHES:
    for _name, _patch in _patches.items():
        _BY_MODULE.setdefault(_name, []).append(_patch)
POST_IMPORT_PATCHES = {name: chained(patches) for name, patches in _BY_MODULE.items()}

_WATCHED = frozenset({"sglang", "sgl_kernel", *POST_IMPORT_PATCHES})


class _TolerantLoader(importlib.abc.Loader):
    """Runs the real ``sgl_kernel`` loader; on ImportError keeps the module with stand-ins."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self._real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            self._real.exec_module(module)
        except ImportError as exc:
            from banaserve.platform import sgl_kernel_fallback

            sgl_kernel_fallback.install(module, exc)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then a patch on the executed module."""

    def __init__(self, real: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]):
        self._real = real
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._real.exec_module(module)
        self._patch(module)


class CpuPlatformFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that prepares ``sglang`` and ``sgl_kernel`` imports for the CPU."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _WATCHED or not cpu_platform_wanted():
            return None
        if fullname == "sglang":
            # SGLang reads these at import time (is_cpu() is cached), so set them first.
            apply_cpu_environment()
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        if fullname == "sgl_kernel":
            spec.loader = _TolerantLoader(spec.loader)
        else:
            spec.loader = _PatchingLoader(spec.loader, POST_IMPORT_PATCHES[fullname])
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path``; idempotent."""
    if not any(isinstance(finder, CpuPlatformFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, CpuPlatformFinder())
