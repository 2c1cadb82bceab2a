"""The bounds a generation request must respect, and a JSON parse that enforces them.

A request body is refused before it is decoded when it is too large (413) or not declared as
JSON (415: a ``text/plain`` POST needs no CORS preflight, so without this check any web page a
user visits could drive a server on localhost), and while it is decoded when it nests deeper
than :attr:`RequestLimits.max_json_depth` (400; Python's ``json`` would otherwise recurse until
``RecursionError``). Every refusal is a :class:`RequestRejected` whose message names the limit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: The defaults of ``--max-request-bytes``, ``--max-json-depth``, ``--max-request-n`` and
#: ``--max-request-sequences``.
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
DEFAULT_MAX_JSON_DEPTH = 32
DEFAULT_MAX_N = 16
DEFAULT_MAX_SEQUENCES = 256
#: OpenAI's documented bounds: ``top_logprobs`` at most 20, ``logit_bias`` values in
#: [-100, 100] (a bias of 100 already bans or forces a token; 1e308 only overflows).
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
#: Stop strings are matched against the output's tail at every decode step, so their count
#: and length bound that work; OpenAI allows 4, frontend programs use a few more.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
#: A ``regex``/``ebnf``/``json_schema``/``structural_tag`` is compiled into a grammar per
#: request before it runs; 64 KiB is far more than any schema seen in SGLang's examples.
MAX_GRAMMAR_BYTES = 64 << 10

JSON_MEDIA_TYPE = "application/json"
#: The ``type`` of an error body, by status, as SGLang's OpenAI server names them.
ERROR_KINDS = {404: "NotFoundError", 408: "RequestTimeoutError", 413: "PayloadTooLargeError",
               415: "UnsupportedMediaTypeError"}  # fmt: skip


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; the operator's flags."""

    max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    #: Most completions one request may ask for (``n``, ``best_of``, ``sampling_params.n``).
    max_n: int = DEFAULT_MAX_N
    #: Most sequences one request may generate: its batch size times ``n``.
    max_sequences: int = DEFAULT_MAX_SEQUENCES
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    max_logit_bias: float = MAX_LOGIT_BIAS
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS
    max_grammar_bytes: int = MAX_GRAMMAR_BYTES

    def __post_init__(self) -> None:
        counts = (self.max_body_bytes, self.max_n, self.max_sequences, self.max_stop_strings,
                  self.max_stop_chars, self.max_grammar_bytes)  # fmt: skip
        if min(counts) < 1 or self.max_json_depth < 2 or self.max_top_logprobs < 0:
            raise ValueError(f"request limits out of range: {self}")
        if not 0 < self.max_logit_bias < float("inf"):
            raise ValueError(f"request limits out of range: {self}")


@dataclass(frozen=True)
class ModelLimits:
    """What the served model can take, as its instances report it."""

    vocab_size: int
    context_length: int
    #: The longest text one token stands for, in UTF-8 bytes: a prompt of ``b`` bytes has at
    #: least ``b / max_token_bytes`` tokens, so a text too long for the context is refused
    #: from its length alone, without tokenising it.
    max_token_bytes: int

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.context_length < 1 or self.max_token_bytes < 1:
            raise ValueError(f"model limits out of range: {self}")


def is_int(value: Any) -> bool:
    """A JSON integer (``true`` is not one, though Python's bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A JSON number."""
    return isinstance(value, int | float) and not isinstance(value, bool)


class RequestRejected(Exception):
    """A request refused before any instance saw it: ``status`` (4xx) and a message that
    says what is wrong; ``param`` names the offending field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def kind(self) -> str:
        return ERROR_KINDS.get(self.status, "BadRequestError")

    def payload(self) -> dict[str, Any]:
        """The error body in the shape SGLang's OpenAI server uses."""
        return {
            "object": "error", "message": self.message, "type": self.kind,
            "param": self.param, "code": self.status,
        }  # fmt: skip


def check_content_type(content_type: str | None) -> None:
    """Accept only ``application/json`` (parameters such as ``charset`` allowed)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != JSON_MEDIA_TYPE:
        shown = content_type or "none"
        raise RequestRejected(
            415, f"The request body must be sent as Content-Type: {JSON_MEDIA_TYPE}, got {shown}."
        )


def check_body_size(size: int, limits: RequestLimits) -> None:
    if size > limits.max_body_bytes:
        raise RequestRejected(
            413,
            f"The request body is {size} bytes, over the limit of {limits.max_body_bytes} "
            "bytes (--max-request-bytes).",
        )


#: A JSON string, escapes included, written as an unrolled loop: runs of plain characters
#: are matched by one fast repeat (20x faster than an alternation per character).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


def json_depth_exceeds(raw: bytes, max_depth: int) -> bool:
    """Whether the JSON text ``raw`` nests arrays/objects deeper than ``max_depth``.

    A body with fewer brackets than the limit cannot nest deeper (most bodies: no scan).
    Otherwise strings are removed first (brackets inside them do not count), then the
    remaining brackets are walked, stopping at the first one too deep. Malformed text is
    left for the parser to report.
    """
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    depth = 0
    for match in _BRACKETS.finditer(_JSON_STRING.sub(b"", raw)):
        if match.group() in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False


def parse_json_object(raw: bytes, limits: RequestLimits) -> dict[str, Any]:
    """Decode a request body within ``limits``; the body must be one JSON object."""
    check_body_size(len(raw), limits)
    if json_depth_exceeds(raw, limits.max_json_depth):
        raise RequestRejected(
            400,
            f"The request body nests JSON deeper than {limits.max_json_depth} levels "
            "(--max-json-depth).",
        )
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestRejected(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestRejected(400, "The request body must be a JSON object.")
    return body
