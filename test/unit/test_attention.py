"""banaserve.attention.partial_attention / merge_many against float64 torch attention.

Token-range partials merged in any order, and head-group partials concatenated back, must equal
attention over everything. CUDA tests skip without a device (benchmark/gpu_check.sh runs them).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from banaserve import _C
from banaserve.attention import merge_attn_states, merge_many, partial_attention

torch = pytest.importorskip("torch")

HAS_CUDA = _C.cuda_compiled() and torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA kernels and a CUDA device")


def reference(
    q, k, v, *, token_range=None, kv_head_groups=None, causal=False, q_positions=None,
    kv_offset=0, scale=None,
):  # fmt: skip
    """Float64 torch attention with the semantics partial_attention documents.

    Returns numpy float64 (out, lse); rows with no visible key have out = 0, lse = -inf.
    """
    q, k, v = (torch.as_tensor(np.asarray(x, dtype=np.float64)) for x in (q, k, v))
    tokens, q_heads, dim = q.shape
    kv_len, kv_heads, _ = k.shape
    group = q_heads // kv_heads
    start, stop = token_range if token_range is not None else (0, kv_len)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,khd->thk", q, k) * scale
    j = torch.arange(kv_len)
    visible = ((j >= start) & (j < stop)).expand(tokens, kv_len)
    if causal:
        if q_positions is None:
            q_positions = np.arange(kv_offset + kv_len - tokens, kv_offset + kv_len)
        pos = torch.as_tensor(np.asarray(q_positions, dtype=np.int64))
        visible = visible & (kv_offset + j[None, :] <= pos[:, None])
    scores = scores.masked_fill(~visible[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None]).nan_to_num(nan=0.0)  # empty rows: 0, not 0/0
    out = torch.einsum("thk,khd->thd", p, v)
    if kv_head_groups is not None:
        heads = [g * group + r for g in kv_head_groups for r in range(group)]
        out, lse = out[:, heads], lse[:, heads]
    return out.numpy(), lse.numpy()


def random_qkv(seed, tokens=6, kv_len=40, q_heads=8, kv_heads=2, dim=64, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((tokens, q_heads, dim))
    k = rng.standard_normal((kv_len, kv_heads, dim))
    v = rng.standard_normal((kv_len, kv_heads, dim))
    return tuple(x.astype(dtype) for x in (q, k, v))


def random_ranges(rng, kv_len, parts):
    """`parts` consecutive ranges covering [0, kv_len), one of them empty, in shuffled order."""
    cuts = np.sort(rng.choice(np.arange(1, kv_len), size=parts - 2, replace=False))
    bounds = [0, *cuts.tolist(), cuts[-1].item(), kv_len]  # the repeated cut: an empty range
    ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
    return [ranges[i] for i in rng.permutation(len(ranges))]


def assert_close(actual, expected, atol, rtol=0.0):
    actual = np.asarray(actual, dtype=np.float64)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype, atol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("q_heads, kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_full_attention_matches_reference(dtype, atol, q_heads, kv_heads):
    q, k, v = random_qkv(0, q_heads=q_heads, kv_heads=kv_heads, dtype=dtype)
    out, lse = partial_attention(q, k, v, scale=0.2)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == dtype and lse.shape == q.shape[:2]
    out_ref, lse_ref = reference(q, k, v, scale=0.2)
    assert_close(out, out_ref, atol, rtol=atol)
    assert_close(lse, lse_ref, atol, rtol=atol)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_token_range_partials_merge_to_full_attention(seed, causal):
    q, k, v = random_qkv(seed, tokens=7, kv_len=53, dim=48)
    rng = np.random.default_rng(seed)
    ranges = random_ranges(rng, 53, parts=4 + seed % 2)
    partials = [partial_attention(q, k, v, token_range=r, causal=causal) for r in ranges]
    out_ref, lse_ref = reference(q, k, v, causal=causal)
    for order in (range(len(partials)), rng.permutation(len(partials))):
        out, lse = merge_many([partials[i] for i in order])
        assert_close(out, out_ref, 1e-5, rtol=1e-5)
        assert_close(lse, lse_ref, 1e-5, rtol=1e-5)
    # Each partial is itself attention over its range.
    start, stop = ranges[0]
    out_ref, lse_ref = reference(q, k, v, token_range=(start, stop), causal=causal)
    assert_close(partials[0][0], out_ref, 1e-5, rtol=1e-5)
    assert_close(partials[0][1], lse_ref, 1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [[[0, 1], [2, 3]], [[3], [0, 2], [1]], [[2, 1, 3, 0]]])
def test_head_group_split_equals_full_attention(split):
    q, k, v = random_qkv(4, q_heads=12, kv_heads=4, dim=32)
    group = 3
    out_full, lse_full = partial_attention(q, k, v)
    outs, lses, heads = [], [], []
    for groups in split:
        out, lse = partial_attention(q, k, v, kv_head_groups=groups)
        assert out.shape == (6, group * len(groups), 32) and lse.shape == (6, group * len(groups))
        out_ref, lse_ref = reference(q, k, v, kv_head_groups=groups)
        assert_close(out, out_ref, 1e-5, rtol=1e-5)
        assert_close(lse, lse_ref, 1e-5, rtol=1e-5)
        outs.append(out)
        lses.append(lse)
        heads += [g * group + r for g in groups for r in range(group)]
    # Concatenating the group outputs and undoing the head order gives full attention exactly:
    # every (token, head) row is computed the same way whichever groups are selected.
    order = np.argsort(heads)
    np.testing.assert_array_equal(np.concatenate(outs, axis=1)[:, order], out_full)
    np.testing.assert_array_equal(np.concatenate(lses, axis=1)[:, order], lse_full)


def test_head_groups_and_token_ranges_combine():
    q, k, v = random_qkv(5, q_heads=8, kv_heads=4, kv_len=30)
    groups = [3, 1]
    partials = [
        partial_attention(q, k, v, token_range=r, kv_head_groups=groups, causal=True)
        for r in [(12, 30), (0, 5), (5, 12)]
    ]
    out, lse = merge_many(partials)
    out_ref, lse_ref = reference(q, k, v, kv_head_groups=groups, causal=True)
    assert_close(out, out_ref, 1e-5, rtol=1e-5)
    assert_close(lse, lse_ref, 1e-5, rtol=1e-5)


def test_causal_masking_by_absolute_position():
    q, k, v = random_qkv(6, tokens=5, kv_len=20)
    positions = np.array([3, 0, 19, 10, 7])  # any order, not just the last positions
    out, lse = partial_attention(q, k, v, causal=True, q_positions=positions)
    out_ref, lse_ref = reference(q, k, v, causal=True, q_positions=positions)
    assert_close(out, out_ref, 1e-5, rtol=1e-5)
    assert_close(lse, lse_ref, 1e-5, rtol=1e-5)
    # Keys after a query's position cannot influence it: scramble them and nothing changes.
    k2, v2 = k.copy(), v.copy()
    k2[4:] = -k2[4:] * 3
    v2[4:] = v2[4:] + 100
    out2, lse2 = partial_attention(q, k2, v2, causal=True, q_positions=positions)
    np.testing.assert_array_equal(out2[[0, 1]], out[[0, 1]])
    np.testing.assert_array_equal(lse2[[0, 1]], lse[[0, 1]])
    assert not np.array_equal(out2[2], out[2])


def test_causal_with_kv_offset_and_default_positions():
    # The caller holds keys at absolute positions 100..139; its queries are the last 6.
    q, k, v = random_qkv(7, tokens=6, kv_len=40)
    out, lse = partial_attention(q, k, v, causal=True, kv_offset=100, token_range=(10, 40))
    out_ref, lse_ref = reference(q, k, v, causal=True, kv_offset=100, token_range=(10, 40))
    assert_close(out, out_ref, 1e-5, rtol=1e-5)
    assert_close(lse, lse_ref, 1e-5, rtol=1e-5)
    # A query before every key of the range sees nothing: lse -inf, out 0.
    out, lse = partial_attention(q, k, v, causal=True, kv_offset=100, q_positions=[99] * 6)
    assert np.all(np.isneginf(lse)) and np.all(out == 0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_empty_range_is_minus_inf_and_merges_as_identity(dtype):
    q, k, v = random_qkv(8, dtype=dtype)
    empty_out, empty_lse = partial_attention(q, k, v, token_range=(17, 17))
    assert np.all(np.isneginf(empty_lse)) and np.all(empty_out == 0)
    full = partial_attention(q, k, v)
    for pairs in ([full, (empty_out, empty_lse)], [(empty_out, empty_lse), full]):
        out, lse = merge_many(pairs)
        np.testing.assert_array_equal(out, full[0])
        np.testing.assert_array_equal(lse, full[1])
    out, lse = partial_attention(q, k[:0], v[:0])  # no keys at all
    assert out.shape == q.shape and np.all(np.isneginf(lse)) and np.all(out == 0)


def test_zero_tokens():
    q, k, v = random_qkv(9, tokens=0)
    out, lse = partial_attention(q, k, v, causal=True, kv_head_groups=[1])
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_float16_within_tolerance():
    q, k, v = random_qkv(10, kv_len=200, dtype=np.float16)
    out_ref, lse_ref = reference(q, k, v, causal=True)  # the float16 values, exactly
    out, lse = partial_attention(q, k, v, causal=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    assert_close(out, out_ref, 2e-3)  # one float16 rounding of |out| < 1, float32 sums
    assert_close(lse, lse_ref, 1e-4, rtol=1e-5)
    out, lse = merge_many(
        partial_attention(q, k, v, causal=True, token_range=r) for r in [(150, 200), (0, 150)]
    )
    assert_close(out, out_ref, 4e-3)  # two more roundings through the merge
    assert_close(lse, lse_ref, 1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 2e-2)])
def test_torch_cpu_tensors(dtype, atol):
    torch_dtype = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(x).to(torch_dtype) for x in random_qkv(11, kv_len=90))
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous view
    out_ref, lse_ref = reference(
        *(x.double().numpy() for x in (q, k, v)), causal=True, kv_head_groups=[1]
    )
    out, lse = partial_attention(q, k, v, causal=True, kv_head_groups=[1])
    assert isinstance(out, torch.Tensor) and out.dtype == torch_dtype
    assert lse.dtype == torch.float32 and out.shape == (6, 4, 64)
    assert_close(out.double().numpy(), out_ref, atol)
    assert_close(lse.double().numpy(), lse_ref, 1e-4, rtol=1e-5)
    merged, _ = merge_many(
        partial_attention(q, k, v, causal=True, kv_head_groups=[1], token_range=r)
        for r in [(30, 90), (0, 30)]
    )
    assert merged.dtype == torch_dtype
    assert_close(merged.double().numpy(), out_ref, 2 * atol)


def test_bfloat16_rounding_matches_torch():
    # One key: out is v rounded through float32 -> bfloat16, which must be torch's rounding.
    rng = np.random.default_rng(12)
    v = torch.from_numpy(rng.standard_normal((1, 2, 256)) * 1e3).float()
    q = torch.from_numpy(rng.standard_normal((3, 2, 256))).to(torch.bfloat16)
    k = torch.from_numpy(rng.standard_normal((1, 2, 256))).to(torch.bfloat16)
    out, _ = partial_attention(q, k, v.to(torch.bfloat16))
    expected = v.to(torch.bfloat16).expand(3, 2, 256)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize(
    "shapes, kwargs, message",
    [
        (((4, 8), (9, 2, 8), (9, 2, 8)), {}, r"q must have shape \[tokens, q_heads, head_dim\]"),
        (((4, 4, 8), (9, 8), (9, 8)), {}, r"k must have shape \[kv_len, kv_heads, head_dim\]"),
        (((4, 4, 8), (9, 2, 8), (9, 2, 4)), {}, r"v shape \(9, 2, 4\) != k shape \(9, 2, 8\)"),
        (((4, 4, 8), (9, 2, 4), (9, 2, 4)), {}, r"head_dim of k \(9, 2, 4\) != head_dim of q"),
        (((4, 6, 8), (9, 4, 8), (9, 4, 8)), {}, r"q_heads \(6\) must be a positive multiple"),
        (((4, 4, 8), (9, 2, 8), (9, 2, 8)), {"token_range": (3, 10)}, r"stop <= kv_len \(9\)"),
        (((4, 4, 8), (9, 2, 8), (9, 2, 8)), {"token_range": (5, 4)}, r"0 <= start <= stop"),
        (((4, 4, 8), (9, 2, 8), (9, 2, 8)), {"token_range": (-1, 4)}, r"0 <= start"),
        (((4, 4, 8), (9, 2, 8), (9, 2, 8)), {"kv_head_groups": [2]}, r"index 2 out of range"),
        (((4, 4, 8), (9, 2, 8), (9, 2, 8)), {"kv_head_groups": [-1]}, r"index -1 out of range"),
        (((4, 4, 8), (9, 2, 8), (9, 2, 8)), {"kv_head_groups": [1, 1]}, r"repeated"),
        (((4, 4, 8), (9, 2, 8), (9, 2, 8)), {"kv_head_groups": []}, r"kv_head_groups is empty"),
        (((4, 4, 8), (9, 2, 8), (9, 2, 8)), {"kv_head_groups": [0.5]}, r"KV-head indices"),
        (
            ((4, 4, 8), (9, 2, 8), (9, 2, 8)),
            {"causal": True, "q_positions": [1, 2]},
            r"q_positions must be 4 integers",
        ),
        (((4, 4, 8), (9, 2, 8), (9, 2, 8)), {"scale": math.nan}, r"scale must be finite"),
    ],
)
def test_bad_arguments_raise_value_error(shapes, kwargs, message):
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    with pytest.raises(ValueError, match=message):
        partial_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "start, stop, groups, message",
    [
        (0, 10, [], r"token_range \[0, 10\) must satisfy"),
        (0, 9, [0, 2], r"index 2 out of range \[0, 2\)"),
        (0, 9, [1, 1], r"index 1 repeated"),
    ],
)
def test_native_entry_point_validates_too(start, stop, groups, message):
    rng = np.random.default_rng(14)
    q = rng.standard_normal((4, 4, 8)).astype(np.float32)
    k = rng.standard_normal((9, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=message):
        _C.partial_attention_cpu(q, k, k, None, start, stop, groups, False, 0, 1.0)
    with pytest.raises(ValueError, match="causal attention needs q_positions"):
        _C.partial_attention_cpu(q, k, k, None, 0, 9, [], True, 0, 1.0)


def test_dtype_errors_raise_type_error():
    q, k, v = random_qkv(15)
    with pytest.raises(TypeError, match="dtypes differ"):
        partial_attention(q, k.astype(np.float64), v)
    with pytest.raises(TypeError, match="unsupported dtype"):
        partial_attention(*(x.astype(np.int32) for x in (q, k, v)))
    with pytest.raises(TypeError, match="three numpy arrays or three tensors"):
        partial_attention(torch.from_numpy(q), k, v)


def test_merge_many_needs_pairs():
    with pytest.raises(ValueError, match="at least one"):
        merge_many([])
    with pytest.raises(ValueError, match=r"partials\[0\] must be an \(out, lse\) pair"):
        merge_many([np.zeros(3)])
    q, k, v = random_qkv(16)
    single = partial_attention(q, k, v)
    assert merge_many(iter([single])) == single


def test_merge_many_agrees_with_pairwise_merge():
    q, k, v = random_qkv(17, kv_len=30)
    a, b = (partial_attention(q, k, v, token_range=r) for r in [(0, 11), (11, 30)])
    np.testing.assert_array_equal(merge_many([a, b])[0], merge_attn_states(*a, *b)[0])


@pytest.mark.skipif(
    not _C.cuda_compiled() or _C.cuda_device_count() > 0, reason="needs CUDA kernels, no device"
)
def test_cuda_kernel_without_device_raises_clearly():
    with pytest.raises(RuntimeError, match="no usable CUDA device"):
        _C.partial_attention_cuda(
            0, 0, 0, 0, 0, 0, 1, 2, 1, 4, 8, 0, 4, [], False, 0, 1.0, _C.ScalarType.float32, 0, 0
        )


def test_cuda_parameters_are_validated_before_the_device():
    if not _C.cuda_compiled():
        pytest.skip("built without CUDA: the CUDA entry point only raises RuntimeError")
    with pytest.raises(ValueError, match=r"index 5 out of range"):
        _C.partial_attention_cuda(
            0, 0, 0, 0, 0, 0, 1, 2, 1, 4, 8, 0, 4, [5], False, 0, 1.0, _C.ScalarType.float32, 0, 0
        )
    with pytest.raises(ValueError, match=r"head_dim 1024 exceeds 512"):
        _C.partial_attention_cuda(
            0, 0, 0, 0, 0, 0, 1, 2, 1, 4, 1024, 0, 4, [], False, 0, 1.0, _C.ScalarType.float32,
            0, 0,
        )  # fmt: skip


# --- CUDA: against float64 and against the CPU kernel (skipped without a device) -------------

CUDA_TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("dim", [128, 64, 7, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_matches_reference_and_cpu(dtype, dim, causal):
    torch_dtype = getattr(torch, dtype)
    host = [torch.from_numpy(x).to(torch_dtype) for x in random_qkv(20, 9, 333, 8, 2, dim)]
    kwargs = {"causal": causal, "token_range": (20, 301), "kv_head_groups": [1, 0]}
    out, lse = partial_attention(*(x.cuda() for x in host), **kwargs)
    torch.cuda.synchronize()
    assert out.is_cuda and out.dtype == torch_dtype and lse.dtype == torch.float32
    out_ref, lse_ref = reference(*(x.double().numpy() for x in host), **kwargs)
    atol = CUDA_TOLERANCE[dtype]
    assert_close(out.double().cpu().numpy(), out_ref, atol)
    assert_close(lse.double().cpu().numpy(), lse_ref, 1e-4, rtol=1e-5)
    out_cpu, lse_cpu = partial_attention(*host, **kwargs)
    assert_close(out.double().cpu().numpy(), out_cpu.double().numpy(), atol)
    assert_close(lse.cpu().numpy(), lse_cpu.double().numpy(), 1e-4, rtol=1e-5)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_token_range_partials_merge_to_full(dtype):
    torch_dtype = getattr(torch, dtype)
    host = [torch.from_numpy(x).to(torch_dtype) for x in random_qkv(21, 16, 500, 8, 4, 128)]
    dev = [x.cuda() for x in host]
    ranges = random_ranges(np.random.default_rng(21), 500, parts=5)
    out, lse = merge_many(
        partial_attention(*dev, token_range=r, causal=True, q_positions=np.arange(100, 116) * 4)
        for r in ranges
    )
    torch.cuda.synchronize()
    out_ref, lse_ref = reference(
        *(x.double().numpy() for x in host), causal=True, q_positions=np.arange(100, 116) * 4
    )
    atol = 1e-5 if dtype == "float32" else 3e-2
    assert_close(out.double().cpu().numpy(), out_ref, atol, rtol=1e-5)
    assert_close(lse.double().cpu().numpy(), lse_ref, 1e-4, rtol=1e-5)


@needs_cuda
def test_cuda_empty_range_and_zero_tokens():
    q, k, v = (torch.from_numpy(x).cuda() for x in random_qkv(22))
    out, lse = partial_attention(q, k, v, token_range=(5, 5))
    torch.cuda.synchronize()
    assert torch.all(torch.isneginf(lse)) and torch.all(out == 0)
    out, lse = partial_attention(q[:0], k, v, causal=True)
    assert out.shape == (0, 8, 64) and lse.shape == (0, 8)
