"""Attention offload in SGLang's torch-native decode (the CPU's attention backend).

With :data:`banaserve.env.ATTENTION_OFFLOAD_ENV` set (JSON, :class:`OffloadSettings`), each
scheduler process starts an attention worker pinned to the settings' cores when its backend
is built, and every decode layer goes through :class:`banaserve.offload.decode_step.DecodeOffload`:
long sequences' attention on the worker, the other rows through SGLang's own
``_run_sdpa_forward_decode``. Unset, nothing changes.

``forward_decode`` is wrapped only to note the layer and the batch's request ids, which
``_run_sdpa_forward_decode`` (wrapped too) is not given; SGLang's code runs unchanged
otherwise, its KV writes included. Cross-attention, sliding windows and encoder models keep
SGLang's path.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import types
from typing import Any

from banaserve.env import ATTENTION_OFFLOAD_ENV
from banaserve.offload.settings import OffloadSettings

logger = logging.getLogger("banaserve.offload")


def patch_attention_offload(module: types.ModuleType) -> None:
    raw = os.environ.get(ATTENTION_OFFLOAD_ENV)
    if not raw:
        return
    settings = OffloadSettings.from_json(raw)
    backend = module.TorchNativeAttnBackend
    backend.__init__ = _starting_worker(backend.__init__, settings)
    backend.forward_decode = _noting_layer(backend.forward_decode)
    backend._run_sdpa_forward_decode = _offloading(backend._run_sdpa_forward_decode)


def _starting_worker(original: Any, settings: OffloadSettings) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, model_runner: Any) -> None:
        original(self, model_runner)
        self._banaserve_offload = _start(self, model_runner, settings)
        self._banaserve_step = None

    return __init__


def _start(backend: Any, model_runner: Any, settings: OffloadSettings) -> Any:
    from banaserve.offload.client import WorkerProcess, area_bytes_for
    from banaserve.offload.decode_step import DecodeOffload, KvLayout

    pool = backend.token_to_kv_pool
    req_to_token = backend.req_to_token_pool.req_to_token
    kv_heads, head_dim = pool.head_num, pool.head_dim
    config = model_runner.model_config
    heads = kv_heads * (config.num_attention_heads // config.num_key_value_heads)  # this rank's
    dtype = pool.get_key_buffer(pool.start_layer).dtype
    # The largest message: a move's one layer of a whole context, or a full batch's attend.
    move = 2 * kv_heads * req_to_token.shape[1] * head_dim * dtype.itemsize + 4096
    area = max(move, area_bytes_for(req_to_token.shape[0], heads, kv_heads, head_dim))
    worker = WorkerProcess(settings.pool_mib << 20, area, settings.cores, settings.timeout_s,
                           transport=settings.transport)  # fmt: skip
    atexit.register(worker.stop)
    logger.info("attention offload: worker %d on cores %s, %d MiB, sequences of %d+ tokens",
                worker.process.pid, list(settings.cores), settings.pool_mib,
                settings.min_tokens)  # fmt: skip
    layout = KvLayout(pool.start_layer, pool.layer_num, kv_heads, heads // kv_heads, head_dim,
                      dtype)  # fmt: skip
    return DecodeOffload(worker.client, layout, settings)


def _noting_layer(original: Any) -> Any:
    @functools.wraps(original)
    def forward_decode(self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                       *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        self._banaserve_step = (layer.layer_id, forward_batch.rids)
        try:
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            self._banaserve_step = None

    return forward_decode


def _offloading(original: Any) -> Any:
    @functools.wraps(original)
    def run_sdpa_forward_decode(self: Any, query: Any, output: Any, k_cache: Any, v_cache: Any,
                                req_to_token: Any, req_pool_indices: Any, seq_lens: Any,
                                encoder_lens: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        step = getattr(self, "_banaserve_step", None)
        window = kwargs.get("sliding_window_size")
        plain = encoder_lens is not None or kwargs.get("is_cross_attn") or (
            window is not None and window > -1
        )  # fmt: skip
        if step is None or step[1] is None or plain:
            return original(self, query, output, k_cache, v_cache, req_to_token,
                            req_pool_indices, seq_lens, encoder_lens, **kwargs)  # fmt: skip
        import torch

        layer_id, rids = step
        lengths = seq_lens.tolist()

        def local(rows: list[int]) -> None:
            if len(rows) == len(lengths):
                original(self, query, output, k_cache, v_cache, req_to_token,
                         req_pool_indices, seq_lens, None, **kwargs)  # fmt: skip
            elif rows:
                index = torch.tensor(rows)
                part = output[index]
                original(self, query[index], part, k_cache, v_cache, req_to_token,
                         req_pool_indices[index], seq_lens[index], None, **kwargs)  # fmt: skip
                output[index] = part

        def slots(i: int) -> Any:
            return req_to_token[req_pool_indices[i], : lengths[i]]

        self._banaserve_offload.attend(layer_id, rids, lengths, slots, query, output, k_cache,
                                       v_cache, kwargs.get("scaling"), local)  # fmt: skip
        return output

    return run_sdpa_forward_decode


POST_IMPORT_PATCHES = {"sglang.srt.layers.attention.torch_native_backend": patch_attention_offload}
