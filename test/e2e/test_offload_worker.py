"""The attention worker as a real process: it answers what attention over the KV it was given
is, over shared memory and over a socket; a move that does not fit is refused with a reason;
a killed worker is reported, never answered for."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import torch

from banaserve.offload.client import (
    LateAnswer,
    OffloadError,
    WorkerGone,
    WorkerProcess,
    area_bytes_for,
)
from banaserve.offload.compute import decode_attention
from banaserve.offload.pool import PartSpec

HEADS, KV_HEADS, DIM, LAYERS, TOKENS = 9, 3, 64, 4, 200  # SmolLM2-135M's head shape
AREA = area_bytes_for(8, HEADS, KV_HEADS, DIM) + TOKENS * KV_HEADS * DIM * 4 * 2 + (1 << 16)
#: Generous: a worker answers in milliseconds; this only bounds a test on a slowed machine.
TIMEOUT_S = 30.0


def spec(seq: str, max_tokens: int = TOKENS + 8) -> PartSpec:
    return PartSpec(seq, LAYERS, (0, KV_HEADS), DIM, max_tokens, HEADS // KV_HEADS)


@pytest.fixture(scope="module", params=["shm", "socket"])
def worker(request: pytest.FixtureRequest) -> Iterator[WorkerProcess]:
    process = WorkerProcess(8 * spec("x").nbytes, AREA, timeout_s=TIMEOUT_S,
                            transport=request.param)  # fmt: skip
    yield process
    assert process.stop() == 0


def test_a_worker_process_answers_attention_over_its_parts(worker: WorkerProcess) -> None:
    torch.manual_seed(3)
    client = worker.client
    kv = {}
    for seq in ("a", "b"):
        client.reserve(spec(seq))
        kv[seq] = [(torch.randn(KV_HEADS, TOKENS, DIM), torch.randn(KV_HEADS, TOKENS, DIM))
                   for _ in range(LAYERS)]  # fmt: skip
        for layer, (k, v) in enumerate(kv[seq]):
            client.write(seq, layer, 0, k, v)
    for _ in range(3):  # three decode steps
        for layer in range(LAYERS):
            q = torch.randn(2, HEADS, DIM)
            new_k, new_v = torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
            out, lse = client.attend(layer, ["a", "b"], q, new_k, new_v, scale=DIM**-0.5)
            for i, seq in enumerate(("a", "b")):
                k, v = kv[seq][layer]
                k = torch.cat([k, new_k[i].unsqueeze(1)], 1)
                v = torch.cat([v, new_v[i].unsqueeze(1)], 1)
                kv[seq][layer] = (k, v)
                want, want_lse = decode_attention(q[i], k, v, DIM**-0.5)
                torch.testing.assert_close(out[i], want, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(lse[i], want_lse, atol=1e-6, rtol=1e-6)
    stats = client.stats()
    assert stats["parts"] == 2 and stats["used_bytes"] == 2 * spec("a").nbytes
    assert client.release("a") and client.release("b")


def test_a_move_that_does_not_fit_is_refused_with_its_reason(worker: WorkerProcess) -> None:
    with pytest.raises(OffloadError, match=r"needs .* MiB .* MiB of .* MiB free") as refused:
        worker.client.reserve(spec("huge", max_tokens=100 * TOKENS))
    assert refused.value.kind == "full"
    assert worker.client.stats()["parts"] == 0


def test_a_killed_worker_is_reported_never_answered_for() -> None:
    process = WorkerProcess(4 * spec("x").nbytes, AREA, timeout_s=TIMEOUT_S)
    client = process.client
    client.reserve(spec("a"))
    client.timeout_s = 2.0  # how long a call waits before it gives the dead worker up
    process.process.send_signal(signal.SIGKILL)
    process.process.wait(TIMEOUT_S)
    with pytest.raises((WorkerGone, LateAnswer)):
        client.attend(0, ["a"], torch.randn(1, HEADS, DIM))
    with pytest.raises((WorkerGone, LateAnswer)):
        client.stats()
    assert process.stop() == -signal.SIGKILL
