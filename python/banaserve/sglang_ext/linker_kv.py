"""The device KV rows as the external linker sees them: :class:`DeviceKv`, checked once against
the store's page layout, and the linker's statistics.

SGLang owns the buffers; a :class:`DeviceKv` only describes them (the loader writes rows SGLang
handed it for a load, the offloader reads rows handed it for an offload).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from banaserve.kvstore.keys import KvLayout

#: The first loads and offloads are logged at INFO (tests read them), later ones at DEBUG.
LOG_FIRST_LOADS = 8
#: The counters of ``BanaServeLinker.stats``, logged when the linker closes.
STAT_NAMES = ("lookup_hits", "load_batches", "loaded_pages", "failed_loads", "offloaded_pages",
              "offloaded_from_capture")  # fmt: skip


def new_stats() -> dict[str, int]:
    """Every counter of :data:`STAT_NAMES` at 0. Written by the scheduler thread (lookups,
    loads) and the offload thread (offloads): each counter by one thread only."""
    return dict.fromkeys(STAT_NAMES, 0)


@dataclass(frozen=True)
class DeviceKv:
    """One K and one V buffer per layer, each ``[rows, heads, head_dim]`` with whole pages of
    ``page_size`` rows, laid out as the store's :class:`KvLayout` pages (layer-major, K then
    V). ``pipeline_device`` is the layer pipeline's device string; ``compute_stream`` the CUDA
    stream the forward computes on (None on the CPU), which every copy is ordered with."""

    k_buffers: Sequence[torch.Tensor]
    v_buffers: Sequence[torch.Tensor]
    page_size: int
    layout: KvLayout
    row_bytes: int
    pipeline_device: str
    compute_stream: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.k_buffers)

    @property
    def device(self) -> torch.device:
        return self.k_buffers[0].device

    @property
    def half_bytes(self) -> int:
        """K (or V) bytes of one page of one layer."""
        return self.row_bytes * self.page_size


def device_kv_of(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                 page_size: int, forward_stream: Any = None) -> DeviceKv:  # fmt: skip
    """The :class:`DeviceKv` of SGLang's per-layer buffers; ValueError when their rows do not
    match the store's page layout or their device is neither CPU nor CUDA."""
    if len(k_buffers) != len(v_buffers) or not k_buffers:
        raise ValueError("BanaServeLinker needs one K and one V buffer per layer")
    first = k_buffers[0]
    layout = KvLayout(
        num_layers=len(k_buffers),
        num_kv_heads=int(first.shape[1]),
        head_dim=int(first.shape[2]),
        dtype=str(first.dtype).removeprefix("torch."),
        page_size=page_size,
    )
    row_bytes = first.stride(0) * first.element_size()
    if 2 * row_bytes * page_size != layout.layer_bytes or any(
        b.stride(0) * b.element_size() != row_bytes or b.dtype != first.dtype
        for b in (*k_buffers, *v_buffers)
    ):
        raise ValueError("BanaServeLinker: KV rows do not match the store's page layout")
    if first.device.type == "cuda":
        device = f"cuda:{first.device.index or 0}"
        stream = int(forward_stream.cuda_stream) if forward_stream is not None else None
    elif first.device.type == "cpu":
        device, stream = "cpu", None
    else:
        raise ValueError(f"BanaServeLinker: unsupported KV device {first.device}")
    return DeviceKv(list(k_buffers), list(v_buffers), page_size, layout, row_bytes, device,
                    stream)  # fmt: skip
