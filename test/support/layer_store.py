"""A stand-in KV pool and forward for the layer-wise store tests."""

from __future__ import annotations

import time

import torch

HEADS, DIM = 2, 8


class Layer:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


class Pool:
    """The writer methods of SGLang's MHA KV pool that LayerWiseStore.attach hooks."""

    def __init__(self, layers: int, rows: int, device: str) -> None:
        self.k_buffer = [torch.zeros(rows, HEADS, DIM, device=device) for _ in range(layers)]
        self.v_buffer = [torch.zeros(rows, HEADS, DIM, device=device) for _ in range(layers)]

    def set_kv_buffer(
        self, layer: Layer, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self.k_buffer[layer.layer_id][loc] = k
        self.v_buffer[layer.layer_id][loc] = v

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        for buffer in (*self.k_buffer, *self.v_buffer):
            buffer[tgt_loc] = buffer[src_loc]


def forward(pool: Pool, loc: list[int] | torch.Tensor, seed: int, compute_s: float = 0.0) -> None:
    """Each layer's new K/V rows at ``loc``, written as an attention backend does."""
    device = pool.k_buffer[0].device
    loc = torch.as_tensor(loc, device=device)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(len(pool.k_buffer)):
        k, v = (torch.randn(len(loc), HEADS, DIM, generator=gen).to(device) for _ in range(2))
        pool.set_kv_buffer(Layer(layer), loc, k, v)
        time.sleep(compute_s)  # the rest of the layer's compute
