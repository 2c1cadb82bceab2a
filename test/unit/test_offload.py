"""The attention worker's pool, its answers and the channel, in one process (threads): the
worker's answers equal attention computed locally, a move that does not fit is refused with a
reason, and a late answer never reaches the wrong call."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from banaserve.attention import merge_attn_states
from banaserve.offload.channel import ShmChannel
from banaserve.offload.client import LateAnswer, OffloadClient, OffloadError, area_bytes_for
from banaserve.offload.compute import decode_attention
from banaserve.offload.pool import KvPool, PartError, PartSpec, PoolFull
from banaserve.offload.worker import AttentionWorker, serve

HEADS, KV_HEADS, DIM, LAYERS = 8, 2, 16, 2


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention in float64, GQA by expanding the KV."""
    group = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = torch.einsum("hd,htd->ht", q.double(), k) / DIM**0.5
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("ht,htd->hd", torch.softmax(scores, -1), v), lse


def test_decode_attention_is_attention_with_its_log_sum_exp() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(HEADS, DIM), *torch.randn(2, KV_HEADS, 37, DIM)
    out, lse = decode_attention(q, k, v)
    want_out, want_lse = reference(q, k, v)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    # Over no tokens: an empty side for the merge.
    empty, empty_lse = decode_attention(q, k[:, :0], v[:, :0])
    assert not empty.any() and torch.isinf(empty_lse).all()


def test_head_groups_concatenate_and_token_ranges_merge_to_the_whole() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(HEADS, DIM), *torch.randn(2, KV_HEADS, 50, DIM)
    whole, whole_lse = decode_attention(q, k, v)
    half = HEADS // 2
    first, _ = decode_attention(q[:half], k[:1], v[:1])
    second, _ = decode_attention(q[half:], k[1:], v[1:])
    assert torch.equal(torch.cat([first, second]), whole)  # bit-exact at one thread or not
    a, lse_a = decode_attention(q, k[:, :20], v[:, :20])
    b, lse_b = decode_attention(q, k[:, 20:], v[:, 20:])
    merged, merged_lse = merge_attn_states(a[None], lse_a[None], b[None], lse_b[None])
    torch.testing.assert_close(merged[0], whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(merged_lse[0], whole_lse, atol=1e-6, rtol=1e-5)


def spec(seq: str, max_tokens: int = 64, kv_heads: tuple[int, int] = (0, KV_HEADS)) -> PartSpec:
    return PartSpec(seq, LAYERS, kv_heads, DIM, max_tokens, HEADS // KV_HEADS)


def test_the_pool_refuses_a_part_that_does_not_fit_and_says_why() -> None:
    pool = KvPool(spec("a").nbytes * 2)
    pool.reserve(spec("a"))
    pool.reserve(spec("b"))
    with pytest.raises(PoolFull, match=r"sequence 'c' needs .* MiB .* 0.0 MiB of"):
        pool.reserve(spec("c"))
    assert set(pool.parts) == {"a", "b"}  # nothing changed
    with pytest.raises(PartError, match="already has a part"):
        pool.reserve(spec("a"))
    assert pool.release("a") and not pool.release("a")
    pool.reserve(spec("c"))  # the released room is free again


def test_writes_are_bounded_and_leave_no_holes() -> None:
    pool = KvPool(1 << 20)
    pool.reserve(spec("a", max_tokens=8))
    kv = torch.randn(KV_HEADS, 5, DIM)
    pool.write("a", 0, 0, kv, kv)
    with pytest.raises(PartError, match="room for 8"):
        pool.write("a", 0, 5, kv, kv)  # 5 + 5 > 8
    with pytest.raises(PartError, match=r"tokens \[6, 11\)"):
        pool.write("a", 1, 6, kv, kv)  # a hole: layer 1 holds nothing yet
    with pytest.raises(PartError, match="want"):
        pool.write("a", 0, 5, kv[:1], kv[:1])
    k, _ = pool.kv("a", 0)
    assert torch.equal(k, kv) and pool.kv("a", 1)[0].shape[1] == 0


@pytest.fixture
def client():
    """A worker serving on a thread over a real shared-memory channel."""
    area = area_bytes_for(4, HEADS, KV_HEADS, DIM) + (1 << 16)
    mine = ShmChannel.create(area)
    memfd, to_worker, to_client = (os.dup(fd) for fd in mine.fds())
    theirs = ShmChannel.attach(memfd, mine.area_bytes, to_worker, to_client)
    worker = AttentionWorker(KvPool(4 * spec("x").nbytes))
    thread = threading.Thread(target=serve, args=(worker, theirs), daemon=True)
    thread.start()
    c = OffloadClient(mine, timeout_s=10.0)
    yield c
    c.stop()
    thread.join(10)
    theirs.close()
    mine.close()


def test_a_worker_answers_attention_over_the_kv_it_was_given(client: OffloadClient) -> None:
    torch.manual_seed(2)
    prompts = {seq: (torch.randn(KV_HEADS, n, DIM), torch.randn(KV_HEADS, n, DIM))
               for seq, n in (("s1", 30), ("s2", 45))}  # fmt: skip
    for seq, (k, v) in prompts.items():
        client.reserve(spec(seq))
        for layer in range(LAYERS):
            client.write(seq, layer, 0, k + layer, v - layer)
    q = torch.randn(2, HEADS, DIM)
    new_k, new_v = torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
    out, lse = client.attend(1, ["s1", "s2"], q, new_k, new_v)
    for i, (k, v) in enumerate(prompts.values()):
        full_k = torch.cat([k + 1, new_k[i].unsqueeze(1)], dim=1)
        full_v = torch.cat([v - 1, new_v[i].unsqueeze(1)], dim=1)
        want, want_lse = decode_attention(q[i], full_k, full_v)
        assert torch.equal(out[i], want) and torch.equal(lse[i], want_lse)
    assert client.stats()["parts"] == 2


def test_refusals_are_clear_and_change_nothing(client: OffloadClient) -> None:
    client.reserve(spec("a"))
    with pytest.raises(OffloadError, match="needs") as full:
        client.reserve(spec("big", max_tokens=10_000))
    assert full.value.kind == "full"
    with pytest.raises(OffloadError, match="no part of sequence 'nope'") as bad:
        client.attend(0, ["a", "nope"], torch.randn(2, HEADS, DIM),
                      torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM))  # fmt: skip
    assert bad.value.kind == "bad"
    # 'a' got nothing appended: the request was checked whole before it wrote.
    out, lse = client.attend(0, ["a"], torch.randn(1, HEADS, DIM))
    assert torch.isinf(lse).all() and client.stats()["parts"] == 1


def test_a_late_answer_never_answers_a_later_call() -> None:
    area = area_bytes_for(1, HEADS, KV_HEADS, DIM) + (1 << 16)
    mine = ShmChannel.create(area)
    memfd, to_worker, to_client = (os.dup(fd) for fd in mine.fds())
    theirs = ShmChannel.attach(memfd, mine.area_bytes, to_worker, to_client)
    worker = AttentionWorker(KvPool(1 << 20))
    c = OffloadClient(mine, timeout_s=0.05)
    try:
        with pytest.raises(LateAnswer):
            c.stats()  # nobody serves yet
        with pytest.raises(LateAnswer, match="earlier late request"):
            c.stats()  # sent nothing: the late one is still unanswered
        header, tensors = theirs.recv(1.0)  # the worker takes the first request now
        theirs.send(*worker.handle(header, tensors))
        thread = threading.Thread(target=serve, args=(worker, theirs), daemon=True)
        thread.start()
        c.timeout_s = 30.0  # a bound for a slowed machine: the worker answers in milliseconds
        assert c.stats()["answered"] == 1  # this call's own answer, not the late one's
        c.stop()
        thread.join(10)
    finally:
        theirs.close()
        mine.close()
