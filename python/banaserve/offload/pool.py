"""The attention worker's KV pool: the part of each migrated sequence's KV the worker holds.

A sequence's part is a range of its KV heads (all of them for a sequence split, a group for a
head-group split) over every layer, for up to ``max_tokens`` tokens: its prompt's KV written
once, then one token appended per decode step. Memory is reserved whole at :meth:`KvPool.reserve`
(so an append never allocates) and bounded by the pool's byte budget: a move that does not fit
is refused with :class:`PoolFull`, saying how much it needed and how much is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PoolFull(Exception):
    """A reservation that does not fit the pool's budget (the message says by how much)."""


class PartError(ValueError):
    """A request about a sequence part that does not match what the pool holds."""


@dataclass(frozen=True)
class PartSpec:
    """What a move hands the worker: ``kv_heads`` of the instance's KV heads
    (``[start, end)``, whole GQA groups) of sequence ``seq`` over ``layers`` layers, room for
    ``max_tokens`` tokens of ``head_dim`` in ``dtype``; ``q_per_kv`` query heads share one KV
    head."""

    seq: str
    layers: int
    kv_heads: tuple[int, int]
    head_dim: int
    max_tokens: int
    q_per_kv: int = 1
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        start, end = self.kv_heads
        counts = (self.layers, self.head_dim, self.max_tokens, self.q_per_kv)
        if not self.seq or not 0 <= start < end or min(counts) < 1:
            raise PartError(f"not a valid sequence part: {self}")

    @property
    def kv_head_count(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V over every layer at ``max_tokens``."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.kv_head_count * self.max_tokens * self.head_dim * itemsize
        return self.layers * per_layer


class Part:
    """One sequence's KV part: ``k[layer]`` and ``v[layer]`` are ``[kv_heads, max_tokens,
    head_dim]``, of which the first ``length`` tokens are written."""

    def __init__(self, spec: PartSpec) -> None:
        self.spec = spec
        shape = (spec.layers, spec.kv_head_count, spec.max_tokens, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype)
        self.v = torch.zeros(shape, dtype=spec.dtype)
        self.lengths = [0] * spec.layers  # tokens written per layer


class KvPool:
    """The worker's parts, within ``budget_bytes``.

    Contract: used by the worker's one serving thread; nothing is locked and nothing blocks.
    Tensors handed in are copied; tensors handed out view the pool and stay valid until the
    part is released.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.parts: dict[str, Part] = {}

    @property
    def used_bytes(self) -> int:
        return sum(part.spec.nbytes for part in self.parts.values())

    def reserve(self, spec: PartSpec) -> None:
        """Room for ``spec``; :class:`PoolFull` if it does not fit, :class:`PartError` if the
        sequence already has a part here."""
        if spec.seq in self.parts:
            raise PartError(f"sequence {spec.seq!r} already has a part on this worker")
        free = self.budget_bytes - self.used_bytes
        if spec.nbytes > free:
            raise PoolFull(
                f"sequence {spec.seq!r} needs {spec.nbytes / 2**20:.1f} MiB for "
                f"{spec.max_tokens} tokens x {spec.layers} layers x {spec.kv_head_count} KV "
                f"heads; {free / 2**20:.1f} MiB of {self.budget_bytes / 2**20:.1f} MiB free"
            )
        self.parts[spec.seq] = Part(spec)

    def release(self, seq: str) -> bool:
        """Forget ``seq``'s part; whether there was one."""
        return self.parts.pop(seq, None) is not None

    def part(self, seq: str) -> Part:
        try:
            return self.parts[seq]
        except KeyError:
            raise PartError(f"no part of sequence {seq!r} on this worker") from None

    def write(self, seq: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens ``[start, start + n)`` of ``layer``'s K and V (``[kv_heads, n, head_dim]``),
        written contiguously from the part's current length at most (no holes)."""
        part = self.part(seq)
        spec = part.spec
        if not 0 <= layer < spec.layers:
            raise PartError(f"layer {layer} outside the part's {spec.layers} layers")
        want = (spec.kv_head_count, k.shape[1] if k.dim() == 3 else -1, spec.head_dim)
        if k.dim() != 3 or tuple(k.shape) != want or tuple(v.shape) != want:
            raise PartError(f"K/V of shape {tuple(k.shape)}/{tuple(v.shape)}, want {want}")
        end = start + k.shape[1]
        if not 0 <= start <= part.lengths[layer] or end > spec.max_tokens:
            raise PartError(
                f"tokens [{start}, {end}) of layer {layer}: {part.lengths[layer]} written, "
                f"room for {spec.max_tokens}"
            )
        part.k[layer, :, start:end] = k
        part.v[layer, :, start:end] = v
        part.lengths[layer] = max(part.lengths[layer], end)

    def kv(self, seq: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``seq``'s written K and V at ``layer``: ``[kv_heads, length, head_dim]``."""
        part = self.part(seq)
        if not 0 <= layer < part.spec.layers:
            raise PartError(f"layer {layer} outside the part's {part.spec.layers} layers")
        n = part.lengths[layer]
        return part.k[layer, :, :n], part.v[layer, :, :n]
