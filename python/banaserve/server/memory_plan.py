"""Check, before anything starts, that a CPU cluster fits in the host memory that is free.

On the CPU every pool is host RAM: each instance's KV pool, its HiCache host pool (by default
twice the KV pool), its weights and its three processes (tokenizer, scheduler, detokenizer),
plus the embedded store. A plan that does not fit does not fail at start-up: it runs until
the pools fill under load and the kernel's OOM killer takes an instance mid-benchmark. So the
cluster refuses such a plan up front, naming what to lower.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from banaserve.server.kv_pool_sizing import dtype_bytes, kv_bytes_per_token

#: Resident memory of one instance's processes besides its pools and weights: the scheduler's
#: runtime and activations, the tokenizer and the detokenizer (PSS measured on the CPU engine
#: with SmolLM2-135M: about 1.0 + 0.9 + 0.9 GB).
PROCESS_BYTES = int(2.5 * 2**30)
#: SGLang's default ``--hicache-ratio``: the host pool holds this many times the KV pool.
DEFAULT_HICACHE_RATIO = 2.0
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
GIB = 2**30


class MemoryPlanError(RuntimeError):
    """The planned cluster needs more host memory than is available."""


@dataclass(frozen=True)
class MemoryPlan:
    """Host memory a CPU cluster will take once its pools fill, against what is free now."""

    instances: int
    kv_pool_bytes: int  # per instance
    host_pool_bytes: int  # per instance
    weights_bytes: int  # per instance
    store_bytes: int  # the embedded store's capacity; 0 for external shards
    available_bytes: int

    @property
    def per_instance_bytes(self) -> int:
        return self.kv_pool_bytes + self.host_pool_bytes + self.weights_bytes + PROCESS_BYTES

    @property
    def total_bytes(self) -> int:
        return self.instances * self.per_instance_bytes + self.store_bytes

    def describe(self) -> str:
        return (
            f"{self.instances} instances x ({_gib(self.kv_pool_bytes)} KV pool + "
            f"{_gib(self.host_pool_bytes)} HiCache host pool + {_gib(self.weights_bytes)} "
            f"weights + {_gib(PROCESS_BYTES)} processes) + {_gib(self.store_bytes)} store = "
            f"{_gib(self.total_bytes)} GiB of {_gib(self.available_bytes)} GiB available"
        )

    def check(self) -> None:
        """Raise :class:`MemoryPlanError` when the plan does not fit."""
        if self.total_bytes <= self.available_bytes:
            return
        raise MemoryPlanError(
            f"the cluster would need about {self.describe()}; the kernel would kill an "
            "instance once the pools fill. Lower --kv-store-capacity-gb, --max-total-tokens "
            "(or --kv-pool-memory-fraction), --hicache-ratio, or the number of instances."
        )


def host_pool_ratio(
    uses_hicache: bool, hicache_ratio: float | None, hicache_size_gb: float
) -> float:
    """The HiCache host pool's size relative to the KV pool when it follows the KV pool (no
    host pool, or a fixed ``--hicache-size``: 0)."""
    if not uses_hicache or hicache_size_gb:
        return 0.0
    return DEFAULT_HICACHE_RATIO if hicache_ratio is None else hicache_ratio


def weights_bytes(model_dir: Path, dtype: str = "auto") -> int:
    """Bytes of the weight files in ``model_dir``, scaled to ``dtype`` when it differs from
    the stored one (fp32 serving of a bf16 checkpoint doubles them); 0 if not a local dir."""
    if not model_dir.is_dir():
        return 0
    stored = sum(f.stat().st_size for f in model_dir.iterdir() if f.name.endswith(_WEIGHT_SUFFIXES))
    config_path = model_dir / "config.json"
    if dtype == "auto" or not config_path.is_file():
        return stored
    config = json.loads(config_path.read_text())
    return stored * dtype_bytes(config, dtype) // dtype_bytes(config)


def plan_memory(
    model_dir: Path, instances: int, kv_pool_tokens: int, dtype: str,
    host_ratio: float, hicache_size_gb: float, store_gb: float, available: int,
) -> MemoryPlan:  # fmt: skip
    """The plan for ``instances`` instances of ``kv_pool_tokens`` tokens each, with a host
    pool of ``hicache_size_gb`` (SGLang's ``--hicache-size``, in GB) or ``host_ratio`` times
    the KV pool (see :func:`host_pool_ratio`)."""
    kv = kv_pool_tokens * kv_bytes_per_token(model_dir, dtype)
    host = int(hicache_size_gb * 1e9) if hicache_size_gb else int(kv * host_ratio)
    return MemoryPlan(
        instances, kv, host, weights_bytes(model_dir, dtype), int(store_gb * GIB), available
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"
