"""The hot instance's side of the offload: start a worker, move parts, ask for attention.

Every wait is bounded (``timeout_s``). An answer that is late raises :class:`LateAnswer`, and
the caller computes that layer's attention locally from its own copy of the KV (or the
store's). The channel carries one request at a time, so after a late answer no new request
is sent until the worker's answer to the late one has come in: calls meanwhile raise
:class:`LateAnswer` at once, without waiting. A worker that died raises
:class:`WorkerGone`; nothing is ever answered wrongly in its place.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from banaserve.offload.channel import SPIN_S, Channel, ShmChannel, SocketChannel
from banaserve.offload.pool import PartSpec
from banaserve.offload.settings import TIMEOUT_S
from banaserve.offload.wire import encoded_size
from banaserve.utils.processes import parent_death_signal

#: Seconds a worker may take to start (it imports torch).
START_TIMEOUT_S = 60.0


class LateAnswer(TimeoutError):
    """No answer within the call's bound (or the worker is still busy with a late one).

    The worker may still carry out the late request, and calls refused meanwhile never reach
    it, so the parts they name may lack tokens: the caller serves those sequences locally
    from then on (and releases their parts)."""


class WorkerGone(ConnectionError):
    """The worker process is not running."""


class OffloadError(RuntimeError):
    """The worker refused a request; ``kind`` is ``full`` (a part that does not fit its pool)
    or ``bad``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


Message = tuple[dict[str, Any], list[torch.Tensor]]
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class OffloadClient:
    """Requests to one worker over ``channel``. Not locked: one caller thread (the decode
    step's). Tensors returned by :meth:`attend` are the caller's own (copied out)."""

    def __init__(self, channel: Channel, timeout_s: float = TIMEOUT_S,
                 alive: Callable[[], bool] | None = None) -> None:  # fmt: skip
        self.channel = channel
        self.timeout_s = timeout_s
        self._alive = alive  # whether the worker still runs (None: assume so)
        self._next_id = 0
        self._behind: int | None = None  # the id of a request whose answer came late

    def _call(self, header: dict[str, Any], tensors: Sequence[torch.Tensor] = (),
              timeout_s: float | None = None) -> Message:  # fmt: skip
        return self._receive(self._send(header, tensors), header["op"], timeout_s)

    def _send(self, header: dict[str, Any], tensors: Sequence[torch.Tensor]) -> int:
        """Send a request; its id, for :meth:`_receive`."""
        self._catch_up()
        self._next_id += 1
        try:
            self.channel.send({**header, "id": self._next_id}, tensors)
        except OSError as exc:  # the socket's other end is gone
            raise WorkerGone(f"the attention worker's channel failed: {exc}") from exc
        return self._next_id

    def _receive(self, rid: int, op: str, timeout_s: float | None = None) -> Message:
        """The answer to request ``rid`` (an ``op``), within ``timeout_s``."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        try:
            answer, out = self._answer_to(rid, bound)
        except TimeoutError:
            self._behind = rid
            self._check_alive()
            raise LateAnswer(f"no answer to {op} within {bound} s") from None
        except OSError as exc:
            raise WorkerGone(f"the attention worker's channel failed: {exc}") from exc
        if not answer.get("ok"):
            raise OffloadError(answer.get("kind", "bad"), answer.get("error", "refused"))
        return answer, out

    def _answer_to(self, rid: int, bound: float) -> Message:
        while True:
            answer, out = self.channel.recv(bound)
            if answer.get("id") == rid:
                return answer, out

    def _catch_up(self) -> None:
        if self._behind is None:
            return
        try:
            self._answer_to(self._behind, 0.0)
        except TimeoutError:
            self._check_alive()
            raise LateAnswer("the worker has not answered an earlier late request yet") from None
        except OSError as exc:
            raise WorkerGone(f"the attention worker's channel failed: {exc}") from exc
        self._behind = None

    def _check_alive(self) -> None:
        if self._alive is not None and not self._alive():
            raise WorkerGone("the attention worker is not running")

    def reserve(self, spec: PartSpec) -> int:
        """Room on the worker for ``spec``; the worker's pool bytes in use after it.
        :class:`OffloadError` (``kind`` ``full``) when it does not fit."""
        answer, _ = self._call({
            "op": "reserve", "seq": spec.seq, "layers": spec.layers,
            "kv_heads": list(spec.kv_heads), "head_dim": spec.head_dim,
            "max_tokens": spec.max_tokens, "q_per_kv": spec.q_per_kv, "dtype": _NAMES[spec.dtype],
        })  # fmt: skip
        return int(answer["used_bytes"])

    def write(self, seq: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens ``[start, start + n)`` of ``layer`` (``[kv_heads, n, dim]`` each)."""
        self._call({"op": "write", "seq": seq, "layer": layer, "start": start}, (k, v))

    def attend(self, layer: int, seqs: Sequence[str], q: torch.Tensor,
               new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Attention of ``q`` (``[n, heads, dim]``, one token per sequence) over each
        sequence's part at ``layer``, the new token's ``new_k``/``new_v`` appended first:
        ``(out [n, heads, dim], lse [n, heads])``."""
        out, lse = self.attend_end(self.attend_begin(layer, seqs, q, new_k, new_v, scale))
        assert lse is not None
        return out, lse

    def attend_begin(self, layer: int, seqs: Sequence[str], q: torch.Tensor,
                     new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None,
                     scale: float | None = None, lse: bool = True) -> int:  # fmt: skip
        """Send :meth:`attend`'s request and return at once (the worker computes while the
        caller does): its id, for :meth:`attend_end`, which must be the next call. Without
        ``lse``, whole sequences' attention computed as SGLang does (a sequence split)."""
        header: dict[str, Any] = {"op": "attend", "layer": layer, "seqs": list(seqs), "lse": lse,
                                  "scale": scale, "append": new_k is not None}  # fmt: skip
        return self._send(header, (q, new_k, new_v) if new_k is not None else (q,))

    def attend_end(self, rid: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The answer to :meth:`attend_begin`'s request ``rid``: ``(out, lse)``, ``lse`` None
        when it was not asked for; the caller's own tensors."""
        _, tensors = self._receive(rid, "attend")
        return tensors[0].clone(), tensors[1].clone() if len(tensors) > 1 else None

    def echo(self, tensors: Sequence[torch.Tensor]) -> None:
        """A round trip that computes nothing: ``tensors`` there and back."""
        self._call({"op": "echo"}, tensors)

    def release(self, seq: str) -> bool:
        answer, _ = self._call({"op": "release", "seq": seq})
        return bool(answer["released"])

    def stats(self) -> dict[str, Any]:
        answer, _ = self._call({"op": "stats"})
        return {k: answer[k] for k in ("used_bytes", "budget_bytes", "parts", "answered")}

    def stop(self, timeout_s: float = 5.0) -> None:
        self._behind = None  # a late answer no longer matters
        self._call({"op": "stop"}, timeout_s=timeout_s)


def area_bytes_for(batch: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Bytes one channel direction needs for an ``attend`` of ``batch`` sequences (float32),
    with room for its header."""
    q = torch.empty(batch, heads, head_dim)
    kv = torch.empty(batch, kv_heads, head_dim)
    header = {"op": "attend", "id": 0, "layer": 0, "scale": 1.0, "append": True,
              "seqs": ["x" * 64] * batch}  # fmt: skip
    return encoded_size(header, [q, kv, kv]) + 4096


class WorkerProcess:
    """An attention worker process and the client that talks to it, over ``transport``
    (``shm``, the default, or ``socket``: a Unix socket pair). The owner calls :meth:`stop`;
    the worker also dies with the thread that started it."""

    def __init__(self, pool_bytes: int, area_bytes: int, cores: Sequence[int] = (),
                 timeout_s: float = TIMEOUT_S, spin_s: float = SPIN_S, transport: str = "shm",
                 start_timeout_s: float = START_TIMEOUT_S) -> None:  # fmt: skip
        argv = [sys.executable, "-m", "banaserve.offload.worker", "--pool-bytes",
                str(pool_bytes), "--parent", str(os.getpid()), "--spin-s", str(spin_s)]  # fmt: skip
        channel: Channel
        if transport == "shm":
            shm = ShmChannel.create(area_bytes, spin_s)
            memfd, to_worker, to_client = passed = shm.fds()
            argv += ["--memfd", str(memfd), "--area-bytes", str(shm.area_bytes),
                     "--in-efd", str(to_worker), "--out-efd", str(to_client)]  # fmt: skip
            channel = shm
        elif transport == "socket":
            mine, theirs = socket.socketpair()
            passed = (theirs.fileno(),)
            argv += ["--socket-fd", str(theirs.fileno()), "--area-bytes", str(area_bytes)]
            channel = SocketChannel(mine, area_bytes)
        else:
            raise ValueError(f"transport must be 'shm' or 'socket', got {transport!r}")
        if cores:
            argv += ["--cores", ",".join(str(c) for c in cores)]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, len(cores))))
        self.process = subprocess.Popen(
            argv, pass_fds=passed, env=env, stdin=subprocess.DEVNULL,
            preexec_fn=parent_death_signal(),
        )  # fmt: skip
        if transport == "socket":
            theirs.close()
        self.client = OffloadClient(channel, timeout_s, alive=lambda: self.process.poll() is None)
        self.channel = channel
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        """Until the worker says it is serving (importing torch takes seconds)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                header, _ = self.channel.recv(0.2)
                break
            except TimeoutError:
                if self.process.poll() is not None:
                    self.stop(0.1)
                    raise WorkerGone(f"the attention worker exited at start "
                                     f"(code {self.process.returncode})") from None  # fmt: skip
                if time.monotonic() > deadline:
                    self.stop(0.1)
                    raise WorkerGone(f"no attention worker after {timeout_s} s") from None
        if not header.get("ready"):
            self.stop(0.1)
            raise WorkerGone(f"the attention worker started wrongly: {header}")

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Stop the worker (asked first, killed if it does not go); its exit code."""
        if self.process.poll() is None:
            try:
                self.client.stop(timeout_s)
                self.process.wait(timeout_s)
            except (TimeoutError, ConnectionError, OffloadError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.channel.close()
        return self.process.returncode
