"""The attention worker: a process pinned to a cold core that holds migrated KV parts in its
bounded pool and answers each layer's attention with output and log-sum-exp. No SGLang.

Requests (the header's ``op``; every answer repeats the request's ``id`` and says ``ok``, or
gives an ``error`` and its ``kind``: ``full`` for a part that does not fit, ``bad`` else):

- ``reserve``: room for a part (:class:`PartSpec`'s fields);
- ``write``: tokens ``[start, start + n)`` of one layer of one part (tensors: K, V);
- ``attend``: one layer's decode attention for ``seqs`` (tensors: queries ``[n, heads, dim]``,
  and with ``append`` the new token's K and V ``[n, kv_heads, dim]``, written first):
  answers output ``[n, heads, dim]`` and LSE ``[n, heads]``; with ``lse`` false (a sequence
  split: whole sequences, nothing to merge) the output alone, computed as SGLang does;
- ``release``, ``stats``, ``stop``; ``echo`` answers its tensors (a transport's own round
  trip, for ``benchmark/offload_roundtrip.py``).

A request that fails changes nothing it did not finish: an ``attend`` checks every sequence
before it appends anything.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

import torch

from banaserve.offload.channel import Channel, ShmChannel, SocketChannel
from banaserve.offload.compute import decode_attention, whole_decode_attention
from banaserve.offload.pool import KvPool, PartError, PartSpec, PoolFull
from banaserve.offload.wire import DTYPES, WireError

Reply = tuple[dict[str, Any], list[torch.Tensor]]
#: Seconds between the serving loop's checks that its parent is still there.
PARENT_CHECK_S = 1.0


class AttentionWorker:
    """Answers requests over one :class:`KvPool`. Not locked: one serving thread."""

    def __init__(self, pool: KvPool) -> None:
        self.pool = pool
        self.answered = 0

    def handle(self, header: dict[str, Any], tensors: Sequence[torch.Tensor]) -> Reply:
        op, rid = header.get("op"), header.get("id")
        try:
            handler = getattr(self, f"_op_{op}", None)
            if handler is None:
                raise PartError(f"unknown op {op!r}")
            out_header, out_tensors = handler(header, list(tensors))
        except PoolFull as exc:
            return {"id": rid, "ok": False, "kind": "full", "error": str(exc)}, []
        except (PartError, WireError, ValueError, KeyError, TypeError, IndexError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            return {"id": rid, "ok": False, "kind": "bad", "error": error}, []
        self.answered += 1
        return {"id": rid, "ok": True, **out_header}, out_tensors

    def _op_reserve(self, h: dict[str, Any], _: list[torch.Tensor]) -> Reply:
        self.pool.reserve(PartSpec(
            seq=h["seq"], layers=h["layers"], kv_heads=tuple(h["kv_heads"]),
            head_dim=h["head_dim"], max_tokens=h["max_tokens"], q_per_kv=h.get("q_per_kv", 1),
            dtype=DTYPES[h.get("dtype", "float32")],
        ))  # fmt: skip
        return {"used_bytes": self.pool.used_bytes}, []

    def _op_write(self, h: dict[str, Any], t: list[torch.Tensor]) -> Reply:
        k, v = t
        self.pool.write(h["seq"], h["layer"], h["start"], k, v)
        return {}, []

    def _op_attend(self, h: dict[str, Any], t: list[torch.Tensor]) -> Reply:
        seqs, layer = list(h["seqs"]), h["layer"]
        q = t[0]
        if q.dim() != 3 or q.shape[0] != len(seqs):
            raise PartError(f"queries of shape {tuple(q.shape)} for {len(seqs)} sequences")
        parts = [self.pool.part(seq) for seq in seqs]  # every sequence checked first
        if h.get("append"):
            k_new, v_new = t[1], t[2]
            for seq, part in zip(seqs, parts, strict=True):
                spec = part.spec
                want = (len(seqs), spec.kv_head_count, spec.head_dim)
                if tuple(k_new.shape) != want or tuple(v_new.shape) != want:
                    raise PartError(f"new K/V of shape {tuple(k_new.shape)}, want {want}")
                if not 0 <= layer < spec.layers or part.lengths[layer] >= spec.max_tokens:
                    raise PartError(f"sequence {seq!r}: no room to append at layer {layer}")
            for i, (seq, part) in enumerate(zip(seqs, parts, strict=True)):
                at = part.lengths[layer]
                self.pool.write(seq, layer, at, k_new[i].unsqueeze(1), v_new[i].unsqueeze(1))
        scale, whole = h.get("scale"), not h.get("lse", True)
        outs, lses = [], []
        for i, seq in enumerate(seqs):
            k, v = self.pool.kv(seq, layer)
            if whole:
                outs.append(whole_decode_attention(q[i], k, v, scale))
                continue
            out, lse = decode_attention(q[i], k, v, scale)
            outs.append(out)
            lses.append(lse)
        return {}, [torch.stack(outs)] + ([torch.stack(lses)] if lses else [])

    def _op_echo(self, _: dict[str, Any], t: list[torch.Tensor]) -> Reply:
        return {}, t

    def _op_release(self, h: dict[str, Any], _: list[torch.Tensor]) -> Reply:
        return {"released": self.pool.release(h["seq"])}, []

    def _op_stats(self, _: dict[str, Any], __: list[torch.Tensor]) -> Reply:
        return {"used_bytes": self.pool.used_bytes, "budget_bytes": self.pool.budget_bytes,
                "parts": len(self.pool.parts), "answered": self.answered}, []  # fmt: skip

    def _op_stop(self, _: dict[str, Any], __: list[torch.Tensor]) -> Reply:
        return {"stopping": True}, []


def serve(worker: AttentionWorker, channel: Channel, parent: int | None = None) -> None:
    """Answer requests until ``stop``, or until the parent process ``parent`` is gone."""
    while True:
        try:
            header, tensors = channel.recv(PARENT_CHECK_S)
        except TimeoutError:
            if parent is not None and os.getppid() != parent:
                return
            continue
        reply, out = worker.handle(header, tensors)
        channel.send(reply, out)
        if header.get("op") == "stop":
            return


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="BanaServe's attention offload worker")
    parser.add_argument("--memfd", type=int, help="shared memory: the mapping's descriptor")
    parser.add_argument("--area-bytes", type=int, required=True, help="bytes per direction")
    parser.add_argument("--in-efd", type=int, help="shared memory: the eventfd to read")
    parser.add_argument("--out-efd", type=int, help="shared memory: the eventfd to write")
    parser.add_argument("--socket-fd", type=int, help="a connected stream socket instead")
    parser.add_argument("--pool-bytes", type=int, required=True)
    parser.add_argument("--cores", default="", help="comma-separated cores to pin to")
    parser.add_argument("--parent", type=int, default=None)
    parser.add_argument("--spin-s", type=float, default=None)
    args = parser.parse_args(argv)
    if args.cores:
        cores = {int(c) for c in args.cores.split(",")}
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    spin = {} if args.spin_s is None else {"spin_s": args.spin_s}
    channel: Channel
    if args.socket_fd is not None:
        channel = SocketChannel(socket.socket(fileno=args.socket_fd), args.area_bytes)
    else:
        channel = ShmChannel.attach(args.memfd, args.area_bytes, args.in_efd, args.out_efd, **spin)
    try:
        channel.send({"ready": True, "pid": os.getpid()})
        serve(AttentionWorker(KvPool(args.pool_bytes)), channel, args.parent)
    finally:
        channel.close()


if __name__ == "__main__":
    main(sys.argv[1:])
