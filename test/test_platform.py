"""The CPU platform: SGLang imports and runs on a machine with no NVIDIA driver."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from banaserve.platform import detect, sgl_kernel_fallback


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter, as SGLang's spawned children are: only the .pth hook applies."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


needs_no_driver = pytest.mark.skipif(
    detect.nvidia_driver_present(), reason="checks the CPU platform on a machine with no driver"
)


@needs_no_driver
def test_fresh_process_gets_cpu_engine_and_kernel_stand_ins() -> None:
    run = run_python(
        "import os, sgl_kernel\n"
        "from sglang.srt.utils.common import is_cpu\n"
        "from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_func\n"
        "import torch\n"
        "print(is_cpu(), os.environ['SGLANG_HOST_IP'], "
        "hasattr(torch.ops.sgl_kernel, 'assign_req_to_token_pool_cpu'))\n"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "127.0.0.1", "True"]


@needs_no_driver
def test_hicache_host_pools_keep_a_cpu_sized_reserve() -> None:
    # SGLang keeps 10 GiB of RAM free beside HiCache host pools, so a store-attached instance
    # would not start on a machine with less free; on the CPU the reserve is 1 GiB.
    run = run_python(
        "from sglang.srt.mem_cache.pool_host import base\n"
        "print(base.HICACHE_HOST_MEMORY_RESERVE_BYTES)\n"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) == 1 << 30


@needs_no_driver
def test_torch_native_attention_scratch_is_zeroed() -> None:
    # Its extend path ran attention over uninitialised query rows; denormals there made CPU
    # attention ~90x slower. Zeroed scratch keeps the kept rows bit for bit.
    run = run_python(
        "import torch\n"
        "from sglang.srt.layers.attention import torch_native_backend as b\n"
        "x = torch.full((4096,), 1e-40)\n"
        "del x\n"
        "print(bool(b.torch.empty(4096).eq(0).all()), bool(b.torch.empty_like(\n"
        "    torch.ones(7)).eq(0).all()), b.torch.float32 is torch.float32)\n"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-3:] == ["True", "True", "True"]


@needs_no_driver
def test_user_environment_wins() -> None:
    run = run_python(
        "import sglang, os; print(os.environ['SGLANG_HOST_IP'])", SGLANG_HOST_IP="127.0.0.2"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "127.0.0.2"


def test_hook_does_nothing_where_cuda_is_usable() -> None:
    # BANASERVE_PLATFORM=cuda makes the hook behave as on a GPU machine: sglang and
    # sgl_kernel load untouched, so on this driverless machine sgl_kernel fails as it
    # does without BanaServe, and no CPU variables are set.
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE",)}
    env["BANASERVE_PLATFORM"] = "cuda"
    run = subprocess.run(
        [sys.executable, "-c",
         "import os, sglang\n"
         "print(os.environ.get('SGLANG_USE_CPU_ENGINE'))\n"
         "try:\n import sgl_kernel\nexcept ImportError:\n print('ImportError')\n"
         "else:\n print('loaded', getattr(sgl_kernel, '__banaserve_fallback__', None))\n"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split()
    assert lines[0] == "None"
    assert lines[1] in ("ImportError", "loaded") and "fallback" not in run.stdout


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
