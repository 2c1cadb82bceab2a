"""The CPU platform in this process: the platform choice, the kernel stand-ins and SGLang's
extend attention on a machine with no NVIDIA driver.

What a fresh interpreter gets (the .pth hook, as SGLang's spawned children) is
``e2e/test_platform_fresh_process.py``.
"""

from __future__ import annotations

import pytest
import torch

from banaserve.platform import detect, sgl_kernel_fallback
from support.platform_marks import needs_no_driver


def test_platform_choice_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(detect.PLATFORM_ENV, "cpu")
    assert detect.cpu_platform_wanted()
    monkeypatch.setenv(detect.PLATFORM_ENV, "cuda")
    assert not detect.cpu_platform_wanted()
    monkeypatch.setenv(detect.PLATFORM_ENV, "tpu")
    with pytest.raises(ValueError, match="BANASERVE_PLATFORM"):
        detect.cpu_platform_wanted()


def test_copy_all_layer_kv_cache_matches_row_copies() -> None:
    generator = torch.Generator().manual_seed(1)
    buffers = [torch.randn(32, 8, 4, generator=generator) for _ in range(3)]
    buffers.append(torch.randn(32, 6, generator=generator).to(torch.bfloat16))
    expected = [b.clone() for b in buffers]
    src = torch.tensor([3, 7, 9, 30])
    tgt = torch.tensor([7, 20, 3, 0])  # overlaps the sources: 3 and 7 are read and written
    for e in expected:
        e[tgt] = e[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers])
    sgl_kernel_fallback.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for got, want in zip(buffers, expected, strict=True):
        assert torch.equal(got, want)


def test_assign_req_to_token_pool_matches_contract() -> None:
    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    out_cache_loc = torch.arange(100, 100 + 9, dtype=torch.int64)
    sgl_kernel_fallback.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([3, 0]),
        torch.tensor([8, 4]),
        out_cache_loc,
        16,
    )
    assert req_to_token[2, 3:8].tolist() == [100, 101, 102, 103, 104]
    assert req_to_token[0, 0:4].tolist() == [105, 106, 107, 108]
    assert req_to_token.sum().item() == sum(range(100, 109))


def test_speculative_stand_ins_explain_themselves() -> None:
    op = sgl_kernel_fallback._unavailable("verify_tree_greedy_cpu")
    with pytest.raises(NotImplementedError, match="Speculative decoding is not supported"):
        op()


def extend_inputs(lengths: list[int], prefixes: list[int], dtype: torch.dtype) -> dict:
    """A batch of sequences in a KV cache, with random (never zero) queries, keys and values.

    The same ``lengths`` give the same tensors whatever ``prefixes`` are cached: the query of
    a position is the same row in every batch built from them."""
    generator = torch.Generator().manual_seed(sum(lengths))
    heads, kv_heads, dim, slots = 6, 2, 16, 4096
    req_to_token = torch.zeros(len(lengths) + 1, max(lengths), dtype=torch.int64)
    free = torch.randperm(slots, generator=generator)
    for i, length in enumerate(lengths):
        req_to_token[i + 1, :length] = free[:length]
        free = free[length:]
    full_query = torch.randn(sum(lengths), heads, dim, generator=generator).to(dtype)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    query = torch.cat(
        [full_query[s + p : s + n] for s, p, n in zip(starts, prefixes, lengths, strict=True)]
    )
    new = [n - p for n, p in zip(lengths, prefixes, strict=True)]
    return {
        "query": query,
        "output": torch.full_like(query, float("nan")),
        "k_cache": torch.randn(slots, kv_heads, dim, generator=generator).to(dtype),
        "v_cache": torch.randn(slots, kv_heads, dim, generator=generator).to(dtype),
        "req_to_token": req_to_token,
        "req_pool_indices": torch.arange(1, len(lengths) + 1),
        "seq_lens": torch.tensor(lengths),
        "extend_prefix_lens": torch.tensor(prefixes),
        "extend_seq_lens": torch.tensor(new),
        "scaling": dim**-0.5,
        "enable_gqa": True,
        "causal": True,
    }


def reference_extend(inputs: dict) -> torch.Tensor:
    """Float64 causal attention of each new token over its sequence, written out longhand."""
    outs, start = [], 0
    for seq, (prefix, new) in enumerate(
        zip(inputs["extend_prefix_lens"].tolist(), inputs["extend_seq_lens"].tolist(), strict=True)
    ):
        tokens = inputs["req_to_token"][inputs["req_pool_indices"][seq], : prefix + new]
        q = inputs["query"][start : start + new].double()  # [new, heads, dim]
        k = inputs["k_cache"][tokens].double().repeat_interleave(3, dim=1)
        v = inputs["v_cache"][tokens].double().repeat_interleave(3, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * inputs["scaling"]
        visible = torch.arange(prefix + new)[None, :] <= (prefix + torch.arange(new))[:, None]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", weights, v))
        start += new
    return torch.cat(outs)


@needs_no_driver
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_attention_is_the_same_cached_or_not(dtype: torch.dtype) -> None:
    # Only the new rows are computed, and a row comes out bit for bit the same whatever part
    # of its sequence was cached (greedy output must not depend on the cache).
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    extend = TorchNativeAttnBackend._run_sdpa_forward_extend
    assert getattr(extend, "__wrapped__", None) is not None, "the import hook did not patch it"
    lengths = [16, 70, 513, 1001, 1056]
    nothing_cached = extend(None, **extend_inputs(lengths, [0] * len(lengths), dtype)).clone()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for shift in (1, 15, 16, 31, 32, 33):
        prefixes = [max(0, n - shift) for n in lengths]  # one new row; pages; a question; ...
        inputs = extend_inputs(lengths, prefixes, dtype)
        got = extend(None, **inputs).clone()
        kept = torch.cat([
            nothing_cached[sum(lengths[:i]) + p : sum(lengths[: i + 1])]
            for i, p in enumerate(prefixes)
        ])  # fmt: skip
        assert torch.equal(got, kept), f"rows differ when {prefixes} are cached"
        torch.testing.assert_close(got.double(), reference_extend(inputs), atol=tolerance, rtol=0)


def test_host_pools_pin_nothing_once_built_on_the_cpu() -> None:
    """The staging page of a storage read without zero-copy (SGLang's ``file`` L3) is
    allocated after the pool is built, with the pool's ``pin_memory``: pinned, it needs an
    NVIDIA driver and every L3 read failed."""
    import types

    from banaserve.platform.hicache_cpu import CPU_HOST_MEMORY_RESERVE_BYTES, patch_pool_host_base

    class HostKVCache:
        def __init__(self, pin_memory: bool) -> None:
            self.pin_memory = pin_memory

    class MHAHost(HostKVCache):
        def get_dummy_flat_data_page(self) -> torch.Tensor:
            return torch.zeros((2, 4), pin_memory=self.pin_memory).flatten()

    module = types.SimpleNamespace(HostKVCache=HostKVCache, HICACHE_HOST_MEMORY_RESERVE_BYTES=10)
    patch_pool_host_base(module)  # type: ignore[arg-type]
    patch_pool_host_base(module)  # type: ignore[arg-type]  # idempotent: wrapped once
    pool = MHAHost(pin_memory=True)
    assert pool.pin_memory is False and pool.get_dummy_flat_data_page().numel() == 8
    assert module.HICACHE_HOST_MEMORY_RESERVE_BYTES == CPU_HOST_MEMORY_RESERVE_BYTES
