"""Attention offload inside a decode step, split by sequence (Adrenaline's split): the whole
attention of the long sequences runs on the attention worker, the rest here, with one round
trip per layer that overlaps the local attention.

An engine hook (:mod:`banaserve.platform.attention_offload_cpu` for SGLang's torch-native
backend) hands each decode layer here with the batch's request ids. At a step's first layer
the step is planned:

- a sequence that has left the batch (finished, aborted or retracted) has its part released;
- a sequence whose context has reached ``min_tokens`` moves: room for its context plus
  ``headroom_tokens`` is reserved on the worker (a refusal keeps it here, with the reason
  logged), and at each layer of that step its KV so far is copied from the instance's pool
  before the attend, so the move takes one step and pauses nothing;
- a moved sequence whose length is not the one its part expects (run again after a
  retraction) or whose part is full is released and served here (and may move again).

Every later layer sends the moved sequences' queries and new K/V (the worker appends them)
and computes the other sequences' attention meanwhile. The worker computes a whole sequence
as SGLang does (:func:`banaserve.offload.compute.whole_decode_attention`), so the output is
bit for bit the engine's own.

In this slice the instance keeps its own copy of the moved KV (freeing it, so the batch can
grow, comes next), so any failure (a late answer, a dead worker, a refusal) falls back
exactly: that layer's moved sequences are computed here, and the offload stops for the rest
of the process, logged once. Nothing is lost or restarted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from banaserve.offload.client import LateAnswer, OffloadClient, OffloadError, WorkerGone
from banaserve.offload.pool import PartSpec
from banaserve.offload.settings import OffloadSettings
from banaserve.offload.wire import WireError

logger = logging.getLogger("banaserve.offload")

#: What a call to the worker may raise; each falls back to local attention (``OSError``: the
#: channel failed; ``WireError``: a message larger than the channel's area).
FAILURES = (LateAnswer, WorkerGone, OffloadError, WireError, OSError)
#: Computes the local attention of the given batch rows into the step's output.
LocalAttention = Callable[[list[int]], None]
#: The pool slots of batch row ``i``'s tokens, in order (``seq_lens[i]`` of them).
Slots = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class KvLayout:
    """The engine's KV: ``layers`` layers numbered from ``first_layer``, ``kv_heads`` KV
    heads shared by ``q_per_kv`` query heads each, ``head_dim`` wide, in ``dtype``."""

    first_layer: int
    layers: int
    kv_heads: int
    q_per_kv: int
    head_dim: int
    dtype: torch.dtype


class DecodeOffload:
    """One engine's sequence-split offload over one worker.

    Contract: called from the engine's forward thread only (the layers of a step in order,
    each step's first layer first); nothing is locked; the worker calls block for at most the
    client's bound. The caller owns every tensor it passes; the worker's answers are copied
    into ``out``.
    """

    def __init__(self, client: OffloadClient, layout: KvLayout,
                 settings: OffloadSettings | None = None) -> None:  # fmt: skip
        self.client = client
        self.layout = layout
        self.settings = settings if settings is not None else OffloadSettings()
        self.held: dict[str, int] = {}  # moved: tokens its part holds after the last step
        self.room: dict[str, int] = {}  # moved: tokens its part has room for
        self.moving: set[str] = set()  # reserved at this step's first layer, copied per layer
        self.refused: set[str] = set()  # the worker had no room: served here while it runs
        self.remote: list[int] = []  # this step's batch rows served by the worker
        self.broken: str | None = None  # why the offload stopped, once it has
        self.moves = self.remote_steps = 0

    def attend(self, layer: int, rids: Sequence[str], seq_lens: Sequence[int], slots: Slots,
               q: torch.Tensor, out: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               scale: float | None, local: LocalAttention) -> None:  # fmt: skip
        """One decode layer: ``q``/``out`` are ``[batch, heads, head_dim]``, ``k_buf``/
        ``v_buf`` the layer's pool (``[slots, kv_heads, head_dim]``, the new tokens' K/V
        already written). Fills every row of ``out``."""
        part_layer = layer - self.layout.first_layer
        if part_layer == 0 and self.broken is None:
            self._plan(rids, seq_lens)
        rows = range(len(rids))
        if self.broken is not None or not self.remote:
            local(list(rows))
            return
        remote = self.remote
        names = [rids[i] for i in remote]
        moved = set(remote)
        others = [i for i in rows if i not in moved]
        try:
            for i in remote:
                if rids[i] in self.moving:
                    tokens = slots(i)[:-1]
                    self.client.write(rids[i], part_layer, 0, _heads_first(k_buf[tokens]),
                                      _heads_first(v_buf[tokens]))  # fmt: skip
            last = torch.stack([slots(i)[-1] for i in remote])
            pending = self.client.attend_begin(
                part_layer, names, q[remote].contiguous(), k_buf[last].contiguous(),
                v_buf[last].contiguous(), scale, lse=False,
            )  # fmt: skip
        except FAILURES as exc:
            self._stop(exc)
            local(list(rows))
            return
        local(others)
        try:
            answer, _ = self.client.attend_end(pending)
        except FAILURES as exc:
            self._stop(exc)
            local(remote)
            return
        out[remote] = answer.to(out.dtype)
        if part_layer == self.layout.layers - 1:
            for i in remote:
                self.held[rids[i]] = seq_lens[i]
            self.moving.clear()
            self.remote_steps += 1

    def _plan(self, rids: Sequence[str], seq_lens: Sequence[int]) -> None:
        in_batch = set(rids)
        for rid in [r for r in self.held if r not in in_batch]:
            self._release(rid)
        self.refused &= in_batch
        self.moving.clear()
        self.remote = []
        for i, (rid, length) in enumerate(zip(rids, seq_lens, strict=True)):
            if self.broken is not None:
                return
            if rid in self.held:
                if self.held[rid] == length - 1 and length <= self.room[rid]:
                    self.remote.append(i)
                    continue
                self._release(rid)  # run again after a retraction, or its part is full
            if rid in self.refused or length - 1 < self.settings.min_tokens:
                continue
            if self._reserve(rid, length):
                self.remote.append(i)

    def _reserve(self, rid: str, length: int) -> bool:
        room = length + self.settings.headroom_tokens
        layout = self.layout
        spec = PartSpec(rid, layout.layers, (0, layout.kv_heads), layout.head_dim, room,
                        layout.q_per_kv, layout.dtype)  # fmt: skip
        try:
            self.client.reserve(spec)
        except OffloadError as exc:
            if exc.kind != "full":
                self._stop(exc)
                return False
            self.refused.add(rid)
            logger.info("attention offload: %s stays here: %s", rid, exc)
            return False
        except FAILURES as exc:
            self._stop(exc)
            return False
        self.room[rid], self.moves = room, self.moves + 1
        self.moving.add(rid)
        logger.info("attention offload: moving %s (%d tokens) to the worker", rid, length - 1)
        return True

    def _release(self, rid: str) -> None:
        self.held.pop(rid, None)
        self.room.pop(rid, None)
        try:
            self.client.release(rid)
        except FAILURES as exc:
            self._stop(exc)

    def _stop(self, exc: Exception) -> None:
        if self.broken is None:
            self.broken = f"{type(exc).__name__}: {exc}"
            logger.warning("attention offload stopped, every sequence is served here: %s",
                           self.broken)  # fmt: skip
        self.held.clear()
        self.room.clear()
        self.moving.clear()
        self.remote = []


def _heads_first(kv: torch.Tensor) -> torch.Tensor:
    """``[tokens, kv_heads, dim]`` (the pool's layout) as ``[kv_heads, tokens, dim]``."""
    return kv.movedim(0, 1).contiguous()
