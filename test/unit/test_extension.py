"""banaserve._C and banaserve.attention.merge_attn_states against float64 attention."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from banaserve import _C
from banaserve.attention import merge_attn_states

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")


def attention_f64(q, k, v, keys):
    """Softmax attention of q over k[keys], v[keys] and its lse, in float64.

    q: [tokens, heads, dim]; k, v: [keys, heads, dim]. Returns out [tokens, heads, dim] and
    lse [tokens, heads]; an empty key range gives lse = -inf and out = NaN (0/0), as a naive
    kernel would.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k[keys], v[keys]))
    scores = np.einsum("thd,khd->thk", q, k) / np.sqrt(q.shape[-1])
    if scores.shape[-1] == 0:
        return np.full(q.shape, np.nan), np.full(q.shape[:2], -np.inf)
    peak = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - peak)
    total = p.sum(axis=-1, keepdims=True)
    out = np.einsum("thk,khd->thd", p / total, v)
    return out, (peak + np.log(total))[..., 0]


def random_qkv(seed, tokens=5, keys=37, heads=4, dim=64, scale=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((tokens, heads, dim)) * scale
    k = rng.standard_normal((keys, heads, dim)) * scale
    v = rng.standard_normal((keys, heads, dim))
    return q, k, v


def split_partials(q, k, v, split):
    out_a, lse_a = attention_f64(q, k, v, slice(0, split))
    out_b, lse_b = attention_f64(q, k, v, slice(split, None))
    out, lse = attention_f64(q, k, v, slice(None))
    return (out_a, lse_a, out_b, lse_b), (out, lse)


def test_extension_imports():
    assert isinstance(_C.cuda_compiled(), bool)
    count = _C.cuda_device_count()
    assert isinstance(count, int)
    if not _C.cuda_compiled():
        assert count == 0  # no CUDA support: no device, whatever the machine has


@needs_torch
@pytest.mark.skipif(not _C.cuda_compiled(), reason="a build without CUDA sees no device")
def test_extension_sees_the_devices_torch_sees():
    import torch

    # Both ask the same CUDA runtime; 0 on a machine without a driver or a device.
    assert _C.cuda_device_count() == torch.cuda.device_count()


@pytest.mark.parametrize(
    "seed, dim, split, scale",
    [(0, 64, 1, 1.0), (1, 128, 18, 1.0), (2, 7, 36, 1.0), (3, 64, 20, 6.0)],
)
def test_merge_float32_equals_full_attention(seed, dim, split, scale):
    # scale=6 makes scores in the hundreds: exp() of them overflows unless max-subtracted.
    q, k, v = random_qkv(seed, dim=dim, scale=scale)
    partials, (out_ref, lse_ref) = split_partials(q, k, v, split)
    out, lse = merge_attn_states(*(x.astype(np.float32) for x in partials))
    assert out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_merge_float64_is_float64_exact():
    q, k, v = random_qkv(4, dim=32)
    partials, (out_ref, lse_ref) = split_partials(q, k, v, 11)
    out, lse = merge_attn_states(*partials)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(out, out_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)


def test_merge_float16_with_float32_lse():
    q, k, v = random_qkv(5, dim=64)
    (out_a, lse_a, out_b, lse_b), (out_ref, lse_ref) = split_partials(q, k, v, 13)
    out, lse = merge_attn_states(
        out_a.astype(np.float16), lse_a.astype(np.float32),
        out_b.astype(np.float16), lse_b.astype(np.float32),
    )  # fmt: skip
    assert out.dtype == np.float16 and lse.dtype == np.float32
    # Two float16 roundings of values below 1 in magnitude.
    np.testing.assert_allclose(out.astype(np.float64), out_ref, atol=2e-3)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_float16_rounding_matches_numpy():
    # Equal lse gives weights of exactly 1/2, so the only rounding left is float32 -> float16,
    # which must be numpy's round-to-nearest-even, subnormals and overflow included.
    rng = np.random.default_rng(6)
    bits = rng.integers(0, 0x7C00, size=(64, 8, 128), dtype=np.uint16)  # finite halves
    sign = rng.integers(0, 2, size=bits.shape, dtype=np.uint16) << 15
    a = (bits | sign).view(np.float16)
    b = rng.permutation(a.reshape(-1)).reshape(a.shape)
    lse = rng.standard_normal(a.shape[:2]).astype(np.float32)
    out, _ = merge_attn_states(a, lse, b, lse.copy())
    expected = (a.astype(np.float32) * 0.5 + b.astype(np.float32) * 0.5).astype(np.float16)
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_empty_range_returns_other_side_unchanged(dtype):
    q, k, v = random_qkv(7)
    out_full, lse_full = attention_f64(q, k, v, slice(None))
    out_empty, lse_empty = attention_f64(q, k, v, slice(0, 0))
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    full = (out_full.astype(dtype), lse_full.astype(lse_dtype))
    empty = (out_empty.astype(dtype), lse_empty.astype(lse_dtype))  # out is NaN: never read
    for side_a, side_b, kept in ((full, empty, full), (empty, full, full)):
        out, lse = merge_attn_states(*side_a, *side_b)
        np.testing.assert_array_equal(out, kept[0])
        np.testing.assert_array_equal(lse, kept[1])


def test_rows_empty_on_one_side_only():
    # Causal splits leave some (token, head) rows with no key in one range.
    q, k, v = random_qkv(8, tokens=9)
    partials, _ = split_partials(q, k, v, 20)
    out_a, lse_a, out_b, lse_b = (x.astype(np.float32) for x in partials)
    rng = np.random.default_rng(8)
    empty_b = rng.random(lse_b.shape) < 0.4
    lse_b[empty_b] = -np.inf
    out_b[empty_b] = np.nan
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    np.testing.assert_array_equal(out[empty_b], out_a[empty_b])
    np.testing.assert_array_equal(lse[empty_b], lse_a[empty_b])
    assert not np.isnan(out).any()


def test_both_empty_gives_zero_and_minus_inf():
    shape = (3, 2, 16)
    nan_out = np.full(shape, np.nan, dtype=np.float32)
    minus_inf = np.full(shape[:2], -np.inf, dtype=np.float32)
    out, lse = merge_attn_states(nan_out, minus_inf, nan_out.copy(), minus_inf.copy())
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out, np.zeros(shape, dtype=np.float32))
    assert np.all(np.isneginf(lse))


def test_zero_tokens():
    out, lse = merge_attn_states(
        np.zeros((0, 4, 8), np.float32), np.zeros((0, 4), np.float32),
        np.zeros((0, 4, 8), np.float32), np.zeros((0, 4), np.float32),
    )  # fmt: skip
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)


def test_non_contiguous_inputs_are_accepted():
    q, k, v = random_qkv(9)
    partials, (out_ref, _) = split_partials(q, k, v, 10)
    out_a, lse_a, out_b, lse_b = (np.asfortranarray(x.astype(np.float32)) for x in partials)
    out, _ = merge_attn_states(out_a, lse_a, out_b, lse_b)
    np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="C-contiguous"):
        _C.merge_attn_states_cpu(out_a, lse_a, out_b, lse_b)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((2, 3, 8), (2, 3), (2, 3, 4), (2, 3)), r"out_b shape \(2, 3, 4\) != out_a shape"),
        (((2, 3, 8), (2, 3), (2, 3, 8), (3, 2)), r"lse_b must have shape \[tokens, heads\]"),
        (((2, 3, 8), (2,), (2, 3, 8), (2, 3)), r"lse_a must have shape \[tokens, heads\]"),
        (((6, 8), (6,), (6, 8), (6,)), r"out_a must have shape \[tokens, heads, head_dim\]"),
    ],
)
def test_shape_mismatch_raises_value_error(shapes, message):
    rng = np.random.default_rng(10)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    with pytest.raises(ValueError, match=message):
        merge_attn_states(*arrays)
    with pytest.raises(ValueError, match=message):
        _C.merge_attn_states_cpu(*arrays)


def test_dtype_mismatch_raises_type_error():
    rng = np.random.default_rng(11)
    out_a = rng.standard_normal((2, 3, 8)).astype(np.float32)
    lse = rng.standard_normal((2, 3)).astype(np.float32)
    with pytest.raises(TypeError, match="dtypes differ"):
        merge_attn_states(out_a, lse, out_a.astype(np.float64), lse)
    with pytest.raises(TypeError, match="unsupported dtype"):
        merge_attn_states(out_a.astype(np.int32), lse, out_a.astype(np.int32), lse)


@pytest.mark.skipif(
    not _C.cuda_compiled() or _C.cuda_device_count() > 0, reason="needs CUDA kernels, no device"
)
def test_cuda_kernels_without_device_raise_clearly():
    with pytest.raises(RuntimeError, match="no usable CUDA device"):
        _C.merge_attn_states_cuda(0, 0, 0, 0, 0, 0, 1, 1, 8, _C.ScalarType.float32, 0, 0)


@needs_torch
@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("float64", 1e-12), ("bfloat16", 2e-2)])
def test_torch_cpu_tensors(dtype, atol):
    import torch

    q, k, v = random_qkv(12, dim=64)
    partials, (out_ref, lse_ref) = split_partials(q, k, v, 17)
    lse_dtype = torch.float64 if dtype == "float64" else torch.float32
    out_a, lse_a, out_b, lse_b = (
        torch.from_numpy(x).to(getattr(torch, dtype) if x.ndim == 3 else lse_dtype)
        for x in partials
    )
    out_a = out_a.transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous view
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert isinstance(out, torch.Tensor) and out.dtype == getattr(torch, dtype)
    assert lse.dtype == lse_dtype
    np.testing.assert_allclose(out.double().numpy(), out_ref, atol=atol)
    np.testing.assert_allclose(lse.double().numpy(), lse_ref, rtol=1e-5, atol=1e-5)


@needs_torch
def test_torch_cuda_tensors_without_kernels_or_device():
    import torch

    if torch.cuda.is_available() and _C.cuda_compiled():
        pytest.skip("a device and the kernels are present: the CUDA test covers this")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device, so no CUDA tensor can be made")
    t = torch.zeros((1, 1, 8), device="cuda")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        merge_attn_states(t, t[..., 0], t, t[..., 0])


@needs_torch
@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("dim", [128, 7])  # vectorized and scalar kernels
def test_torch_cuda_tensors(dtype, atol, dim):
    import torch

    if not (_C.cuda_compiled() and torch.cuda.is_available()):
        pytest.skip("needs the CUDA kernels and a CUDA device")
    q, k, v = random_qkv(13, tokens=33, keys=300, heads=8, dim=dim, scale=3.0)
    (out_a, lse_a, out_b, lse_b), (out_ref, lse_ref) = split_partials(q, k, v, 120)
    lse_b[::3] = -np.inf  # some rows with an empty range B
    out_b[::3] = np.nan
    out_ref[::3], lse_ref[::3] = out_a[::3], lse_a[::3]
    torch_dtype = getattr(torch, dtype)
    out, lse = merge_attn_states(
        torch.from_numpy(out_a).to("cuda", torch_dtype), torch.from_numpy(lse_a).float().cuda(),
        torch.from_numpy(out_b).to("cuda", torch_dtype), torch.from_numpy(lse_b).float().cuda(),
    )  # fmt: skip
    torch.cuda.synchronize()
    assert out.is_cuda and out.dtype == torch_dtype and lse.dtype == torch.float32
    np.testing.assert_allclose(out.double().cpu().numpy(), out_ref, atol=atol)
    np.testing.assert_allclose(lse.double().cpu().numpy(), lse_ref, rtol=1e-5, atol=1e-5)
