"""Which instances a cluster runs, on which ports and cores."""

from __future__ import annotations

from dataclasses import dataclass

from banaserve.router.base import Role

PREFILL, DECODE = Role.PREFILL, Role.DECODE


@dataclass(frozen=True)
class InstanceSpec:
    """One SGLang instance of the cluster. ``cores`` is empty when it is not pinned."""

    name: str
    role: str
    port: int
    cores: tuple[int, ...] = ()

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
