"""``--migration layer``'s layout: which instances run as two stages, on which cores, and
where each one's boundary is, by instance name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from banaserve.cluster.migration_loop import HISTORY
from banaserve.cluster.topology import DECODE, InstanceSpec
from banaserve.config.pipeline_options import LayerSplit
from banaserve.env import THREADS_BIND_ENV


@dataclass
class LayerLayout:
    """The split instances of one cluster, by name: the boundary each started at
    (``start``; an instance restarted whole leaves it), the boundary each reports now
    (``boundaries``), the cores of each one's stages (``stage_cores``), and the moves so far.

    Owned by the gateway's :class:`banaserve.cluster.layer_loop.LayerMigration` and mutated only
    on its event loop (nothing is locked); ``/migration`` reports :meth:`to_json`."""

    boundary: int
    num_layers: int
    start: dict[str, int]
    boundaries: dict[str, int]
    stage_cores: dict[str, list[list[int]]]
    moves: int = 0
    bytes_moved: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, specs: list[InstanceSpec], split: LayerSplit) -> LayerLayout:
        """The layout of ``specs`` (from :func:`banaserve.cluster.topology.lend_decode_layers`)
        as they start, every split instance at ``split``'s boundary."""
        stages = {}
        for spec in specs:
            bind = dict(spec.env).get(THREADS_BIND_ENV)
            if spec.role == DECODE and bind is not None:
                stages[spec.name] = [[int(c) for c in part.split(",")] for part in bind.split("|")]
        start = {spec.name: split.boundary for spec in specs if spec.unsplit}
        return cls(split.boundary, split.num_layers, start, dict(start), stages)

    def is_split(self, name: str) -> bool:
        """``name`` still runs as two stages (it was split and never restarted whole)."""
        return name in self.start

    def record_move(self, name: str, move: dict[str, Any], bytes_moved: int) -> None:
        """A move an instance took (``move``: :meth:`LayerMove.to_json`), into the history."""
        self.history.append({"instance": name, **move})
        del self.history[:-HISTORY]
        self.moves += 1
        self.bytes_moved += bytes_moved

    def record_fallback(self, whole: InstanceSpec, at: float) -> None:
        """``whole`` (an instance's ``unsplit`` spec) now runs as one stage on its own cores:
        its boundary is L for good, and the history says why."""
        before = self.boundaries.get(whole.name, self.num_layers)
        self.start.pop(whole.name, None)
        self.boundaries[whole.name] = self.num_layers
        self.stage_cores[whole.name] = [list(whole.cores)] if whole.cores else []
        self.history.append({
            "instance": whole.name, "from": before, "to": self.num_layers, "at": round(at, 3),
            "bytes_moved": 0, "reason": "the instance died: restarted as one stage",
        })  # fmt: skip
        del self.history[:-HISTORY]

    def to_json(self) -> dict[str, Any]:
        """The layout as ``/migration`` reports it (without the controller's part)."""
        return {
            "mode": "layer", "boundary": self.boundary, "num_layers": self.num_layers,
            "stage_cores": self.stage_cores, "boundaries": self.boundaries,
            "moves": self.moves, "bytes_moved": self.bytes_moved, "history": self.history,
        }  # fmt: skip
