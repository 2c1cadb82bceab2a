"""The gateway's request intake: parse, validate and measure a body off the event loop.

Every generation request passes here before any instance sees it. The work (JSON decoding
within :class:`~banaserve.api.request_limits.RequestLimits`, the field checks of
:mod:`banaserve.api.request_validation`, tokenising the prompt for routing and for the
context check, the body's digest) runs on a few worker threads, so the event loop, and with
it ``/health``, never waits on a large body. The tokenizer releases the GIL (it is called in
batch form), and a text longer than the context can hold is refused from its byte length
before it is tokenised, so no body costs more than one context's worth of tokenising.

At most ``max_pending`` requests are in the intake at once (queued or running); one more is
answered 503 at once rather than queued without bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from banaserve.api.request_limits import (
    ModelLimits,
    RequestLimits,
    RequestRejected,
    parse_json_object,
)
from banaserve.api.request_validation import CHAT, too_long_message, validate_generation
from banaserve.router.request_shape import RequestShape, shape_request

logger = logging.getLogger("banaserve.cluster")

#: The defaults of the intake's size; threads mostly wait in the tokenizer, without the GIL.
INTAKE_WORKERS = 2
INTAKE_MAX_PENDING = 64
#: Normalizers may shrink a text before it is tokenised (accents stripped, NFKC): the byte
#: bound of :class:`ModelLimits` allows for that much.
NORMALIZATION_SLACK = 2

CountTokens = Callable[[str], int]


class IntakeBusy(Exception):
    """The intake holds ``max_pending`` requests already; answered 503."""


@dataclass(frozen=True)
class Admitted:
    """A request that may be routed: its decoded body, shape and digest (of path and decoded
    body: the identity under which a request that crashes instances is quarantined)."""

    body: dict[str, Any]
    shape: RequestShape
    digest: str


def body_digest(path: str, body: dict[str, Any]) -> str:
    """The digest of what a request asks: its path and its decoded body, keys sorted, so a
    resend with other spacing, key order or escapes is the same request (not its bytes)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{path}\0{canonical}".encode("utf-8", "surrogatepass")).hexdigest()[:16]


def admit(
    path: str,
    raw: bytes,
    limits: RequestLimits,
    model: ModelLimits | None,
    count_tokens: CountTokens | None,
) -> Admitted:
    """Parse and check one body (blocking: run it off the event loop). Raises
    :class:`RequestRejected`. Without ``model`` only the JSON limits and ``n`` are checked."""
    body = parse_json_object(raw, limits)
    if model is not None:
        validate_generation(path, body, model, limits)
    shape = shape_request(path, body, count_tokens)
    # The count is exact for a text prompt; for chat it leaves out the template, so it can
    # only be short of what the instance will count, never over.
    counted = count_tokens is not None or path == CHAT
    # Each prompt of a batch runs as a request of its own: the longest must fit, not the sum.
    if model is not None and counted and shape.longest_prompt_tokens >= model.context_length:
        raise RequestRejected(400, too_long_message(shape.longest_prompt_tokens, model))
    return Admitted(body, shape, body_digest(path, body))


class Intake:
    """Admits requests on worker threads; used from one event loop (the pending count is not
    locked). Owns its threads: :meth:`close` stops them."""

    def __init__(
        self,
        limits: RequestLimits | None = None,
        model: ModelLimits | None = None,
        count_tokens: CountTokens | None = None,
        workers: int = INTAKE_WORKERS,
        max_pending: int = INTAKE_MAX_PENDING,
    ) -> None:
        self.limits = limits or RequestLimits()
        self.model = model
        self.count_tokens = count_tokens
        self.max_pending = max_pending
        self.pending = 0
        self.busy_refusals = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="gateway-intake")

    async def admit(self, path: str, raw: bytes) -> Admitted:
        """Admit ``raw`` (a body the caller has checked is JSON by its Content-Type)."""
        if self.pending >= self.max_pending:
            self.busy_refusals += 1
            raise IntakeBusy(
                f"the gateway is checking {self.pending} requests already; try again shortly"
            )
        self.pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._pool, admit, path, raw, self.limits, self.model, self.count_tokens
            )
        finally:
            self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def load_tokenizer(model_path: str) -> tuple[CountTokens | None, int | None]:
    """The prompt-length counter for routing and the longest token's byte length (with
    :data:`NORMALIZATION_SLACK`); (None, None) when the tokenizer cannot load (lengths are
    then estimated from characters, and texts are bounded by the body size alone)."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # noqa: BLE001 - any failure only costs routing precision
        logger.warning("no tokenizer for routing (%s): estimating from characters", exc)
        return None, None

    def count(text: str) -> int:
        # The batch form runs without the GIL, so other threads and the loop keep going.
        return len(tokenizer([text], add_special_tokens=False)["input_ids"][0])

    # A token's string is at least as long in UTF-8 as the text it stands for: byte-level
    # BPE maps each byte to one character, SentencePiece writes a space as a 3-byte "▁".
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()),
                  default=1)  # fmt: skip
    return count, max(1, longest) * NORMALIZATION_SLACK


def model_vocab_size(model_path: str) -> int | None:
    """``vocab_size`` of the model's config (what its embedding takes), if it says."""
    import json

    try:
        config = json.loads(Path(model_path, "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None
