"""Content-addressed page keys: chained over the prefix, namespaced by model, layout, tenant."""

from __future__ import annotations

import random

import pytest

from banaserve.kvstore.keys import KEY_BYTES, KvLayout, Namespace, namespaced_key, page_keys

LAYOUT = KvLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
NS = Namespace("tiny-llama", LAYOUT, tenant="a")


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def test_keys_cover_full_pages_only() -> None:
    keys = page_keys(NS, tokens(4 * 3 + 2))
    assert len(keys) == 3
    assert all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 3
    assert page_keys(NS, tokens(3)) == []


def test_a_prefix_shares_its_keys_and_a_change_breaks_the_chain_after_it() -> None:
    seq = tokens(24)
    full = page_keys(NS, seq)
    assert page_keys(NS, seq[:12]) == full[:3]
    changed = list(seq)
    changed[9] += 1  # inside page 2
    other = page_keys(NS, changed)
    assert other[:2] == full[:2]
    assert all(a != b for a, b in zip(other[2:], full[2:], strict=True))


def test_same_page_at_another_position_has_another_key() -> None:
    page = tokens(4, seed=1)
    assert page_keys(NS, page + page)[0] != page_keys(NS, page + page)[1]


@pytest.mark.parametrize(
    "other",
    [
        Namespace("other-model", LAYOUT, tenant="a"),
        Namespace("tiny-llama", LAYOUT, tenant="b"),
        Namespace("tiny-llama", KvLayout(4, 2, 8, "bfloat16", 4), tenant="a"),
        Namespace("tiny-llama", KvLayout(4, 1, 16, "float16", 4), tenant="a"),
        Namespace("tiny-llama", KvLayout(3, 2, 8, "float16", 4), tenant="a"),
    ],
)
def test_namespaces_never_share_keys(other: Namespace) -> None:
    seq = tokens(16)
    assert not set(page_keys(NS, seq)) & set(page_keys(other, seq))
    assert namespaced_key(NS.digest(), "abc") != namespaced_key(other.digest(), "abc")


def test_layout_sizes_and_layer_ranges() -> None:
    assert LAYOUT.layer_bytes == 2 * 4 * 2 * 8 * 2
    assert LAYOUT.page_bytes == 4 * LAYOUT.layer_bytes
    assert LAYOUT.layer_range(1, 3) == (LAYOUT.layer_bytes, 2 * LAYOUT.layer_bytes)
    with pytest.raises(ValueError, match="layer range"):
        LAYOUT.layer_range(2, 5)
    with pytest.raises(ValueError, match="dtype"):
        KvLayout(4, 2, 8, "int3", 4)
    with pytest.raises(ValueError, match="page_size"):
        KvLayout(4, 2, 8, "float16", 0)
