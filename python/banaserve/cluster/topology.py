"""Which instances a cluster runs, on which ports and cores."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from banaserve.config.pipeline_options import (
    BOUNDARY_FLAG,
    BOUNDARY_PP_SIZE,
    MIN_BOUNDARY_FLAG,
    LayerSplit,
)
from banaserve.env import THREADS_BIND_ENV
from banaserve.router.base import Role

PREFILL, DECODE = Role.PREFILL, Role.DECODE
#: The smallest boundary a split instance of the cluster may move to: its second stage holds
#: buffers for layers [MIN_BOUNDARY, L) (the KV the stages share is mapped once).
MIN_BOUNDARY = 1


@dataclass(frozen=True)
class InstanceSpec:
    """One SGLang instance of the cluster. ``cores`` is empty when it is not pinned.
    ``args`` and ``env`` are this instance's own additions to the launch flags and the
    environment every instance gets. ``unsplit`` is set on an instance that runs as two
    pipeline stages: the same instance whole, on its own cores, as it restarts when it died
    (a stage on a borrowed core failing takes the instance down with it)."""

    name: str
    role: str
    port: int
    cores: tuple[int, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    unsplit: InstanceSpec | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def plan_cores(num_instances: int, available: list[int]) -> list[tuple[int, ...]]:
    """Give each instance its own cores: an equal share of ``available``, in order.

    With more instances than cores, instances share cores round-robin (one core each), which
    is still better than letting every instance's threads roam over every core.
    """
    if num_instances <= 0:
        return []
    if not available:
        raise ValueError("no cores available to pin instances to")
    share = max(1, len(available) // num_instances)
    plans = []
    for i in range(num_instances):
        start = (i * share) % len(available)
        plans.append(tuple(available[(start + j) % len(available)] for j in range(share)))
    return plans


def plan_instances(
    num_prefill: int, num_decode: int, ports: list[int], cores: list[tuple[int, ...]] | None
) -> list[InstanceSpec]:
    """Prefill instances first, then decode ones; ``ports`` and ``cores`` in that order."""
    roles = [PREFILL] * num_prefill + [DECODE] * num_decode
    if len(ports) != len(roles):
        raise ValueError(f"need {len(roles)} ports, got {len(ports)}")
    specs = []
    counts = {PREFILL: 0, DECODE: 0}
    for i, role in enumerate(roles):
        name = f"{role}-{counts[role]}"
        counts[role] += 1
        specs.append(InstanceSpec(name, role, ports[i], cores[i] if cores else ()))
    return specs


def lend_decode_layers(specs: list[InstanceSpec], split: LayerSplit) -> list[InstanceSpec]:
    """``--migration layer``'s layout: each decode instance runs as two pipeline stages whose
    boundary moves (down to :data:`MIN_BOUNDARY`), starting with layers [0, k) on its own
    cores and [k, L) on the cores of a prefill instance that has
    cores to itself (with 2 prefill + 1 decode on two cores: prefill-1's core 1), so decode
    work reaches a core that prefills leave idle. Stage 0 stays on the decode instance's own
    cores (``SGLANG_CPU_OMP_THREADS_BIND`` set in that order, which the instance's launcher
    keeps). Unpinned instances only become two-stage.

    Raises ValueError when a pinned decode instance finds no prefill instance to lend it a
    core of its own.
    """
    uses = Counter(core for spec in specs for core in spec.cores)
    lenders = [
        s for s in specs if s.role == PREFILL and s.cores and all(uses[c] == 1 for c in s.cores)
    ]
    flags = ("--pp-size", str(BOUNDARY_PP_SIZE), BOUNDARY_FLAG, str(split.boundary),
             MIN_BOUNDARY_FLAG, str(MIN_BOUNDARY))  # fmt: skip
    out = []
    for spec in specs:
        if spec.role != DECODE:
            out.append(spec)
            continue
        if not spec.cores:
            out.append(dataclasses.replace(spec, args=spec.args + flags, unsplit=spec))
            continue
        if not lenders:
            raise ValueError(
                f"--migration layer: {spec.name} needs a prefill instance pinned to cores of its "
                "own to run its later layers on (e.g. --num-prefill 2 --num-decode 1 on 2 cores)"
            )
        lender = lenders.pop(0)
        bind = "|".join(",".join(map(str, cores)) for cores in (spec.cores, lender.cores))
        out.append(dataclasses.replace(
            spec, cores=spec.cores + lender.cores, args=spec.args + flags,
            env=spec.env + ((THREADS_BIND_ENV, bind),), unsplit=spec,
        ))  # fmt: skip
    return out
