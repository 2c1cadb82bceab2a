"""Offload inside a decode step, on a real worker (a thread over a shared-memory channel)
against SGLang's own torch-native decode attention: every step's output is bit for bit what
the engine computes alone, whatever moved, finished, came back or failed."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from banaserve.offload.channel import ShmChannel
from banaserve.offload.client import OffloadClient, area_bytes_for
from banaserve.offload.decode_step import DecodeOffload, KvLayout
from banaserve.offload.pool import KvPool
from banaserve.offload.settings import OffloadSettings
from banaserve.offload.worker import AttentionWorker, serve
from support.platform_marks import needs_no_driver

LAYERS, HEADS, KV_HEADS, DIM = 3, 9, 3, 16  # GQA as SmolLM2's: 3 query heads per KV head
SLOTS, MAX_LEN = 4096, 600
MIN = 40
SCALE = DIM**-0.5


class Worker:
    """A worker serving on a thread; ``client`` talks to it."""

    def __init__(self, pool_bytes: int) -> None:
        area = 2 * KV_HEADS * MAX_LEN * DIM * 4 + area_bytes_for(8, HEADS, KV_HEADS, DIM)
        self.mine = ShmChannel.create(area)
        memfd, to_worker, to_client = (os.dup(fd) for fd in self.mine.fds())
        self.theirs = ShmChannel.attach(memfd, self.mine.area_bytes, to_worker, to_client)
        self.worker = AttentionWorker(KvPool(pool_bytes))
        self.thread = threading.Thread(target=serve, args=(self.worker, self.theirs), daemon=True)
        self.thread.start()
        self.client = OffloadClient(self.mine, timeout_s=10.0)

    def close(self) -> None:
        if self.thread.is_alive():
            self.client.stop()
            self.thread.join(10)
        self.theirs.close()
        self.mine.close()


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker(64 << 20)
    yield w
    w.close()


class Engine:
    """A decode batch over a KV pool laid out as SGLang's (``[slots, kv_heads, dim]`` per
    layer, ``req_to_token`` rows per request)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        self.k = [torch.randn(SLOTS, KV_HEADS, DIM, generator=gen) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, KV_HEADS, DIM, generator=gen) for _ in range(LAYERS)]
        self.req_to_token = torch.zeros(16, MAX_LEN, dtype=torch.int64)
        self.lengths: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        self.next_slot = 0
        self.gen = gen

    def start(self, rid: str, length: int) -> None:
        """A request whose prompt of ``length - 1`` tokens is in the pool (its first decode
        step adds one)."""
        self.rows[rid] = row = len(self.rows)
        self.lengths[rid] = length - 1
        self.req_to_token[row, : length - 1] = self._slots(length - 1)

    def _slots(self, n: int) -> torch.Tensor:
        slots = torch.arange(self.next_slot, self.next_slot + n)
        self.next_slot += n
        return slots

    def step(self, rids: list[str], offload: DecodeOffload | None) -> torch.Tensor:
        """One decode step of ``rids``: each gains a token; the outputs of every layer."""
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        sdpa = TorchNativeAttnBackend._run_sdpa_forward_decode
        for rid in rids:
            self.req_to_token[self.rows[rid], self.lengths[rid]] = self._slots(1)
            self.lengths[rid] += 1
        pool_rows = torch.tensor([self.rows[r] for r in rids])
        seq_lens = torch.tensor([self.lengths[r] for r in rids])
        outs = []
        for layer in range(LAYERS):
            q = torch.randn(len(rids), HEADS, DIM, generator=self.gen)
            out = torch.zeros_like(q)
            kv = (self.k[layer], self.v[layer], self.req_to_token)

            def local(rows: list[int], q: torch.Tensor = q, out: torch.Tensor = out,
                      kv: tuple = kv) -> None:  # fmt: skip
                if rows:
                    index = torch.tensor(rows)
                    part = out[index]
                    sdpa(None, q[index], part, *kv, pool_rows[index], seq_lens[index],
                         scaling=SCALE, enable_gqa=True)  # fmt: skip
                    out[index] = part

            if offload is None:
                local(list(range(len(rids))))
            else:
                offload.attend(layer, rids, seq_lens.tolist(),
                               lambda i: self.req_to_token[pool_rows[i], : seq_lens[i]],
                               q, out, self.k[layer], self.v[layer], SCALE, local)  # fmt: skip
            outs.append(out)
        return torch.stack(outs)


def moving_at_min(headroom: int) -> OffloadSettings:
    return OffloadSettings(min_tokens=MIN, headroom_tokens=headroom)


def layout() -> KvLayout:
    return KvLayout(0, LAYERS, KV_HEADS, HEADS // KV_HEADS, DIM, torch.float32)


def run_both(steps: list[list[str]], offload: DecodeOffload, starts: dict[str, int],
             restarts: dict[int, dict[str, int]] | None = None) -> None:  # fmt: skip
    """The same steps with and without the offload (same inputs): equal bit for bit."""
    restarts = restarts or {}
    plain, offloaded = Engine(), Engine()
    for engine in (plain, offloaded):
        for rid, length in starts.items():
            engine.start(rid, length)
    for n, rids in enumerate(steps):
        for rid, length in restarts.get(n, {}).items():  # retracted and run again
            for engine in (plain, offloaded):
                engine.lengths[rid] = length - 1
        want, got = plain.step(rids, None), offloaded.step(rids, offload)
        assert torch.equal(got, want), f"step {n}: {(got - want).abs().max()}"


@needs_no_driver
def test_long_sequences_move_and_every_step_is_the_engines_own(worker: Worker) -> None:
    offload = DecodeOffload(worker.client, layout(), moving_at_min(64))
    starts = {"short": 10, "long": 300, "growing": MIN - 2}
    steps = [["short", "long", "growing"]] * 6 + [["short", "growing"]] * 2
    run_both(steps, offload, starts)
    # "long" moved at once, "growing" when it reached MIN; "long" left and was released.
    assert offload.moves == 2 and offload.broken is None
    assert set(offload.held) == {"growing"} and worker.worker.pool.parts.keys() == {"growing"}
    assert offload.remote_steps == 8


@needs_no_driver
def test_a_full_part_and_a_rerun_sequence_come_back_and_move_again(worker: Worker) -> None:
    offload = DecodeOffload(worker.client, layout(), moving_at_min(2))
    starts = {"a": 100, "b": 200}
    # Room for 2 tokens past the move: "a" fills its part and moves again; "b" is retracted
    # at step 3 and runs again from 150 tokens.
    run_both([["a", "b"]] * 6, offload, starts, restarts={3: {"b": 150}})
    assert offload.moves >= 4 and offload.broken is None


@needs_no_driver
def test_a_sequence_the_worker_has_no_room_for_stays_here() -> None:
    one = 2 * LAYERS * KV_HEADS * (300 + 64) * DIM * 4  # room for one long sequence
    small = Worker(one + 1)
    try:
        offload = DecodeOffload(small.client, layout(), moving_at_min(64))
        run_both([["x", "y"]] * 3, offload, {"x": 300, "y": 300})
        assert offload.moves == 1 and offload.refused == {"y"} and offload.broken is None
    finally:
        small.close()


@needs_no_driver
def test_a_worker_that_stops_answering_leaves_every_sequence_served_here(worker: Worker) -> None:
    offload = DecodeOffload(worker.client, layout(), moving_at_min(64))
    plain, offloaded = Engine(), Engine()
    for engine in (plain, offloaded):
        engine.start("long", 300)
    assert torch.equal(offloaded.step(["long"], offload), plain.step(["long"], None))
    worker.client.stop()  # the worker is gone from here on
    worker.thread.join(10)
    worker.client.timeout_s = 0.05
    for _ in range(2):
        assert torch.equal(offloaded.step(["long"], offload), plain.step(["long"], None))
    assert offload.broken is not None and not offload.held
