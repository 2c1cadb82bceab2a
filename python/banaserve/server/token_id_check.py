"""Token ids checked against the vocabulary where SGLang tokenises, for every route.

SGLang's tokenizer manager checks a prompt's length (``_validate_one_request``) but not its
ids, and an id outside ``[0, vocab)`` reaches the model's embedding and kills the scheduler:
one ``PUT /generate`` ended a single server for good. The request guard checks the bodies it
knows (:mod:`banaserve.server.request_guard`); this check is the floor under it, for every
route and every body shape (scoring, reranking, embeddings, Ollama, Anthropic, sessions),
because every prompt, text or ids, passes ``_validate_one_request`` before it is sent to the
scheduler. It wraps that method in the HTTP server's process (SGLang's files are untouched):
a bad id raises ``ValueError``, which SGLang answers with a 400, and nothing is scheduled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from banaserve.api.request_validation import vocabulary_error

_MARK = "_banaserve_checks_token_ids"


def checking_ids(validate: Callable[..., None]) -> Callable[..., None]:
    """``TokenizerManager._validate_one_request`` that also refuses out-of-vocabulary ids."""

    def validate_one_request(self: Any, obj: Any, input_ids: list[int] | None) -> None:
        validate(self, obj, input_ids)
        wrong = vocabulary_error(input_ids or [], "input_ids", self.model_config.vocab_size)
        if wrong is not None:
            raise ValueError(wrong)

    setattr(validate_one_request, _MARK, True)
    return validate_one_request


def install() -> None:
    """Wrap SGLang's per-request validation in this process (idempotent)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    if not getattr(TokenizerManager._validate_one_request, _MARK, False):
        TokenizerManager._validate_one_request = checking_ids(
            TokenizerManager._validate_one_request
        )
