"""A module as one patched SGLang module sees it: a few names replaced, the rest the real ones.

Patches that must change what a name means inside one SGLang module only (``torch.cuda.Event``
in the PD prefill scheduler, ``torch.empty`` in the torch-native attention backend) replace that
module's global ``torch`` with a view; every other module keeps the real ``torch``.
"""

from __future__ import annotations

import types
from typing import Any


class ModuleView:
    """``real`` with the names in ``overrides`` replaced; every other name resolves to
    ``real``'s, looked up on each access."""

    def __init__(self, real: types.ModuleType, **overrides: Any) -> None:
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def view_torch_of(module: types.ModuleType, **overrides: Any) -> None:
    """Give ``module`` a ``torch`` with ``overrides``; nothing when it has no ``torch`` module."""
    real = getattr(module, "torch", None)
    if isinstance(real, types.ModuleType):
        module.torch = ModuleView(real, **overrides)  # type: ignore[attr-defined]
