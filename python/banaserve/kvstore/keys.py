"""Content-addressed page keys.

A page of ``page_size`` tokens is keyed by a chained SHA-256: the key of page i hashes the key
of page i-1 with page i's token ids, and the chain starts from the digest of the namespace
(model id, KV layout, tenant). So a key names the whole prefix up to its page, and two models,
two layouts or two tenants never share a key. Keys are 32 raw bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

KEY_BYTES = 32
_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class KvLayout:
    """How one page's KV bytes are laid out: layer-major, then K before V.

    Page bytes = ``num_layers`` blocks of ``layer_bytes``; each block is K then V, each
    ``[page_size, num_kv_heads, head_dim]`` of ``dtype``. Layer-major order makes the layers
    [a, b) of a page one contiguous byte range, which the layer-wise pipeline fetches alone.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}: one of {sorted(_DTYPE_SIZES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KvLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def layer_bytes(self) -> int:
        item = _DTYPE_SIZES[self.dtype]
        return 2 * self.page_size * self.num_kv_heads * self.head_dim * item

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def layer_range(self, start: int, stop: int) -> tuple[int, int]:
        """(offset, length) in bytes of layers [start, stop) within a page."""
        if not 0 <= start < stop <= self.num_layers:
            raise ValueError(f"layer range [{start}, {stop}) outside [0, {self.num_layers})")
        return start * self.layer_bytes, (stop - start) * self.layer_bytes


@dataclass(frozen=True)
class Namespace:
    """Who may share pages: the same model, KV layout and tenant."""

    model_id: str
    layout: KvLayout
    tenant: str = ""

    def digest(self) -> bytes:
        h = hashlib.sha256(b"banaserve-kv-namespace-v1")
        layout = self.layout
        for part in (self.model_id, self.tenant, layout.dtype):
            data = part.encode()
            h.update(struct.pack("<Q", len(data)) + data)
        h.update(
            struct.pack(
                "<5Q",
                layout.num_layers,
                layout.num_kv_heads,
                layout.head_dim,
                layout.page_size,
                _DTYPE_SIZES[layout.dtype],
            )
        )
        return h.digest()


def page_keys(namespace: Namespace, token_ids: Sequence[int]) -> list[bytes]:
    """Keys of the full pages of ``token_ids``; a trailing partial page has no key."""
    page = namespace.layout.page_size
    keys: list[bytes] = []
    prior = namespace.digest()
    for start in range(0, len(token_ids) - page + 1, page):
        chunk = struct.pack(f"<{page}q", *token_ids[start : start + page])
        prior = hashlib.sha256(prior + chunk).digest()
        keys.append(prior)
    return keys


def namespaced_key(namespace_digest: bytes, external_key: str) -> bytes:
    """A store key for a key chained elsewhere (SGLang HiCache's hex page hashes)."""
    return hashlib.sha256(namespace_digest + external_key.encode()).digest()
