"""Size SGLang's KV pool from the host memory that is free, for the CPU engine.

On the CPU, SGLang's own default takes a fixed fraction of all RAM for the KV pool, which
starves every other process on a 24 GiB machine; BanaServe sizes it from the model's KV
bytes per token and the memory available now.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

#: Never size the pool below this many tokens (a few long requests) ...
MIN_TOKENS = 4096
#: ... nor above this many: more only costs start-up time on a CPU that cannot fill it.
MAX_TOKENS = 131072


@dataclass(frozen=True)
class KvPoolSize:
    """The chosen size and how it was derived, for the start-up message."""

    tokens: int
    bytes_per_token: int
    budget_bytes: int
    available_bytes: int


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """``MemAvailable`` from the kernel: what can be allocated without swapping."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no MemAvailable line in {meminfo}")


def kv_bytes_per_token(model_dir: Path, dtype: str = "auto") -> int:
    """K and V bytes one token takes across all layers of the model in ``model_dir``."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return 2 * layers * kv_heads * head_dim * dtype_bytes(config, dtype)


def layer_weight_bytes(model_dir: Path, dtype: str = "auto") -> int:
    """The parameter bytes of one decoder layer of the (Llama-shaped) model in ``model_dir``:
    its attention and MLP projections and its two norms (what a layer move sends)."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    hidden, inner = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    params = 2 * hidden * q + 2 * hidden * kv + 3 * hidden * inner + 2 * hidden
    return params * dtype_bytes(config, dtype)


def dtype_bytes(config: dict, dtype: str = "auto") -> int:
    """Bytes per element of ``dtype``; ``auto`` means the dtype the model config stores."""
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return _DTYPE_BYTES.get(dtype.removeprefix("torch."), 4)


def size_kv_pool(
    model_dir: Path, memory_fraction: float, dtype: str = "auto", available: int | None = None,
    host_ratio: float = 0.0,
) -> KvPoolSize:  # fmt: skip
    """Tokens that fit in ``memory_fraction`` of the available host memory, clamped.

    ``host_ratio``: a HiCache host pool of that many times the KV pool comes out of the same
    budget (on the CPU both are host RAM).
    """
    if not 0.0 < memory_fraction <= 0.9:
        raise ValueError(f"KV pool memory fraction must be in (0, 0.9], got {memory_fraction}")
    available = available_memory_bytes() if available is None else available
    per_token = kv_bytes_per_token(model_dir, dtype)
    budget = int(available * memory_fraction)
    tokens = max(MIN_TOKENS, min(MAX_TOKENS, int(budget / (1.0 + host_ratio)) // per_token))
    return KvPoolSize(tokens, per_token, budget, available)
