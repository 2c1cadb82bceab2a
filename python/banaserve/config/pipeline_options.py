"""SGLang's pipeline parallelism (``--pp-size``) as the launcher sets it up: BanaServe's
``--pp-layer-boundary`` flag and the environment SGLang's pipeline stages read.

SGLang takes a pipeline's layer split and the CPU cores of its ranks from the environment,
not from flags: ``SGLANG_PP_LAYER_PARTITION="k,L-k"`` (``distributed/utils.py``
``get_pp_indices``, read when each stage builds its model) and
``SGLANG_CPU_OMP_THREADS_BIND="cores of rank 0|cores of rank 1|..."``
(``utils/numa_utils.py`` ``init_threads_binding``: without it, more ranks than NUMA nodes fail
an assertion, so ``--pp-size 2`` fails on a one-node machine). :func:`pipeline_env` computes
both; the launcher exports them before SGLang starts its scheduler processes, which inherit
them. Everything here is pure: the caller passes the cores, the model folder and the
environment it would change.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from banaserve.env import LAYER_PARTITION_ENV, THREADS_BIND_ENV

BOUNDARY_FLAG = "--pp-layer-boundary"
MIN_BOUNDARY_FLAG = "--pp-min-boundary"
#: The pipeline depth a layer boundary splits into: two stages, [0, k) and [k, L).
BOUNDARY_PP_SIZE = 2


def add_pipeline_args(group: argparse._ArgumentGroup) -> None:
    """Add ``--pp-layer-boundary`` (default None: SGLang's even split) to ``group``."""
    group.add_argument(
        BOUNDARY_FLAG,
        type=int,
        default=None,
        metavar="K",
        help="With --pp-size 2, the first pipeline stage runs layers [0, K) and the second "
        "[K, L), L being the model's num_hidden_layers; 1 <= K <= L-1 (default: SGLang's even "
        "split).",
    )
    group.add_argument(
        MIN_BOUNDARY_FLAG,
        type=int,
        default=None,
        metavar="KMIN",
        help=f"With {BOUNDARY_FLAG} K, make the boundary movable at run time between KMIN and "
        "L (POST /pp_boundary): the second stage allocates KV for layers [KMIN, L) and "
        "receives their weights when the boundary moves down; 1 <= KMIN <= K.",
    )


@dataclass(frozen=True)
class LayerSplit:
    """A two-stage split of ``num_layers`` layers at ``boundary``: [0, k) and [k, L)."""

    boundary: int
    num_layers: int

    @property
    def partition(self) -> str:
        """The value of ``SGLANG_PP_LAYER_PARTITION``: each stage's layer count."""
        return f"{self.boundary},{self.num_layers - self.boundary}"


def model_num_layers(model_dir: Path) -> int:
    """``num_hidden_layers`` of the model in ``model_dir`` (of its text model, for a
    multimodal config). Raises ValueError when there is no readable ``config.json``."""
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
        config = config.get("text_config", config)
        return int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{BOUNDARY_FLAG} needs the model's layer count: cannot read num_hidden_layers "
            f"from {config_path} ({type(exc).__name__}: {exc})"
        ) from exc


def check_boundary_flags(boundary: int | None, pp_size: int) -> None:
    """The checks that need no model: ``--pp-layer-boundary`` only with ``--pp-size 2``.
    Raises ValueError with a one-line message."""
    if boundary is not None and pp_size != BOUNDARY_PP_SIZE:
        raise ValueError(
            f"{BOUNDARY_FLAG} splits a two-stage pipeline: it needs --pp-size "
            f"{BOUNDARY_PP_SIZE} (got --pp-size {pp_size})"
        )


def layer_split(
    boundary: int | None, pp_size: int, model_dir: Path, movable: bool = False
) -> LayerSplit | None:
    """The split ``--pp-layer-boundary`` asks for; None when it is not given. Raises
    ValueError (one line) when the flags do not fit together or the model. ``movable``: the
    boundary moves at run time, so it may start at L (stage 1 idle until it moves down)."""
    check_boundary_flags(boundary, pp_size)
    if boundary is None:
        return None
    return checked_split(boundary, model_num_layers(model_dir), movable)


def checked_split(boundary: int, layers: int, movable: bool = False) -> LayerSplit:
    """``LayerSplit(boundary, layers)``; ValueError (one line) unless 1 <= boundary <= L-1
    (or L, when the boundary is ``movable``: a fixed split needs a layer in each stage)."""
    highest = layers if movable else layers - 1
    if not 1 <= boundary <= highest:
        raise ValueError(
            f"{BOUNDARY_FLAG} {boundary} is out of range: the model has {layers} layers, so "
            f"it must be between 1 and {highest}"
        )
    return LayerSplit(boundary, layers)


def lending_split(boundary: int | None, pp_size: int, model_dir: Path) -> LayerSplit:
    """``--migration layer``'s split of each decode instance: ``--pp-layer-boundary``, or L
    (a decode instance starts whole and lends layers once the controller finds it pays). The
    cluster makes the decode instances two-stage itself, so ``--pp-size`` must be left alone.
    ValueError (one line) otherwise."""
    if pp_size != 1:
        raise ValueError(
            "--migration layer makes each decode instance a two-stage pipeline itself: drop "
            f"--pp-size {pp_size}"
        )
    layers = model_num_layers(model_dir)
    if layers < 2:
        raise ValueError(f"--migration layer needs a model of 2 layers or more, got {layers}")
    return checked_split(layers if boundary is None else boundary, layers, movable=True)


def movable_env(split: LayerSplit | None, lowest: int | None, split_dir: Path) -> dict[str, str]:
    """The variables that make ``split``'s boundary movable down to ``lowest`` (none when
    ``lowest`` is None), the stages sharing ``split_dir``. ValueError (one line) when
    ``lowest`` comes without a split or outside [1, k]."""
    from banaserve.env import MOVABLE_ENV, SPLIT_DIR_ENV

    if lowest is None:
        return {}
    if split is None:
        raise ValueError(f"{MIN_BOUNDARY_FLAG} moves the boundary {BOUNDARY_FLAG} sets: give both")
    if not 1 <= lowest <= split.boundary:
        raise ValueError(
            f"{MIN_BOUNDARY_FLAG} {lowest} is out of range: it must be between 1 and "
            f"{BOUNDARY_FLAG} ({split.boundary})"
        )
    return {MOVABLE_ENV: str(lowest), SPLIT_DIR_ENV: str(split_dir)}


def split_from_env(environ: Mapping[str, str]) -> LayerSplit:
    """The split ``SGLANG_PP_LAYER_PARTITION`` in ``environ`` describes ("k,L-k")."""
    first, second = (int(part) for part in environ[LAYER_PARTITION_ENV].split(","))
    return LayerSplit(first, first + second)


def threads_bind(ranks: int, cores: Sequence[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks on ``cores`` (the process's CPU
    affinity): the cores in contiguous shares, the first ranks taking one more when they do
    not divide evenly; with fewer cores than ranks, ranks share them round robin. Entries
    are comma-separated core ids, the form SGLang itself derives from NUMA nodes."""
    if ranks < 1 or not cores:
        raise ValueError(f"need at least one rank and one core (ranks={ranks}, cores={cores})")
    ordered = sorted(set(cores))
    if len(ordered) < ranks:
        shares = [[ordered[rank % len(ordered)]] for rank in range(ranks)]
    else:
        base, extra = divmod(len(ordered), ranks)
        shares, start = [], 0
        for rank in range(ranks):
            size = base + (rank < extra)
            shares.append(ordered[start : start + size])
            start += size
    return "|".join(",".join(map(str, share)) for share in shares)


def pipeline_env(
    split: LayerSplit | None,
    ranks: int,
    cores: Sequence[int],
    environ: Mapping[str, str],
    *,
    cpu: bool,
) -> dict[str, str]:
    """The variables to export so that SGLang runs ``ranks`` ranks (dp x tp x pp) with
    ``split``; a variable already in ``environ`` is the user's and is left alone (not in the
    result). ``cpu``: SGLang's CPU engine, which needs the thread binding once there is more
    than one rank. Raises ValueError when the user's ``SGLANG_PP_LAYER_PARTITION`` says
    otherwise than ``split``."""
    env: dict[str, str] = {}
    if split is not None:
        given = environ.get(LAYER_PARTITION_ENV)
        if given is None:
            env[LAYER_PARTITION_ENV] = split.partition
        elif given.replace(" ", "") != split.partition:
            raise ValueError(
                f"{BOUNDARY_FLAG} {split.boundary} means {LAYER_PARTITION_ENV}="
                f"{split.partition}, but the environment sets it to {given!r}: unset one"
            )
    if cpu and ranks > 1 and not environ.get(THREADS_BIND_ENV):
        env[THREADS_BIND_ENV] = threads_bind(ranks, cores)
    return env
