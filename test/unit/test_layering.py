"""Imports run one way: from the entry points down to the pure cores (issue 29).

The packages of ``banaserve`` sit in layers, top first; a module may import its own package
and any package of a lower layer, never one of its own layer or above. Every import counts,
the ones inside functions too (a late import is still a dependency). A new package must be
given a layer here, which is where its place is decided.
"""

from __future__ import annotations

import ast
from pathlib import Path

#: The source tree, not the installed copy: the layout under review is the one in the repository.
PACKAGE_DIR = Path(__file__).resolve().parents[2] / "python" / "banaserve"

LAYERS: list[tuple[str, ...]] = [
    ("launch_server",),  # the entry point: one instance or a whole cluster
    ("cluster",),  # gateway, supervisor, processes, the migration loops
    ("server", "sglang_ext", "platform"),  # what one SGLang instance adds, and its patches
    ("config",),  # typed options of the launcher, the store, the pipeline
    ("kvstore", "pipeline", "models", "attention", "offload"),  # the store and the data paths
    ("migration",),  # pure: the controllers
    ("router",),  # pure: routing, placement, the load board
    ("api", "env", "utils", "_C", "__init__"),  # request checks, variable names, helpers
]
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}
#: What the pure cores must not pull in, whatever the layers say.
PURE = {"router", "migration", "api", "env"}
NOT_PURE = ("aiohttp", "asyncio", "subprocess", "multiprocessing", "requests", "sglang", "torch")


def package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py").split(".")[0]


def imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            if node.module == "banaserve":  # ``from banaserve import _C``
                names += [f"banaserve.{a.name}" for a in node.names]
    return names


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_package_has_a_layer() -> None:
    assert {package_of(p) for p in modules()} <= set(LAYER_OF)


def test_no_import_runs_upward_or_sideways() -> None:
    offenders = []
    for path in modules():
        here = package_of(path)
        for name in imports(path):
            parts = name.split(".")
            if parts[0] != "banaserve" or len(parts) < 2 or parts[1] == here:
                continue
            if LAYER_OF[parts[1]] <= LAYER_OF[here]:
                offenders.append(f"{path.relative_to(PACKAGE_DIR)} imports {name}")
    assert offenders == []


def test_the_pure_cores_import_no_servers_processes_or_engines() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE_DIR)} imports {name}"
        for path in modules()
        if package_of(path) in PURE
        for name in imports(path)
        if name.split(".")[0] in NOT_PURE
    ]
    assert offenders == []
