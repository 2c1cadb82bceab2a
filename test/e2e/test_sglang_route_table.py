"""Every route of SGLang's server is classified, so a route added by a new SGLang cannot reach
it unchecked; and the token-id check wraps SGLang's own validation. (Here, not in test/unit:
importing SGLang's server starts a process.)"""

from __future__ import annotations

from typing import Any

from banaserve.api.sglang_routes import ADMIN, GENERATING, READ_ONLY
from banaserve.server import token_id_check


def sglang_paths() -> set[str]:
    """The path of every route of SGLang's app, included routers walked."""
    from sglang.srt.entrypoints.http_server import app

    paths: set[str] = set()

    def walk(routes: list[Any], prefix: str) -> None:
        for route in routes:
            if hasattr(route, "original_router"):
                walk(route.original_router.routes, prefix + (route.include_context.prefix or ""))
            else:
                paths.add(prefix + route.path)

    walk(app.routes, "")
    return paths


def test_every_route_of_sglang_is_classified_once() -> None:
    tables = [set(GENERATING), set(ADMIN), set(READ_ONLY)]
    unclassified = sglang_paths() - set().union(*tables)
    assert not unclassified, (
        f"routes SGLang serves that no BanaServe table classifies: {unclassified}"
    )
    assert sum(len(t) for t in tables) == len(set().union(*tables)), "a path in two tables"
    # Nothing stale either: every classified path is one SGLang serves.
    assert set().union(*tables) <= sglang_paths()


def test_the_token_id_check_wraps_sglangs_validation_once() -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    original = TokenizerManager._validate_one_request
    try:
        token_id_check.install()
        installed = TokenizerManager._validate_one_request
        token_id_check.install()  # idempotent: wrapped once
        assert TokenizerManager._validate_one_request is installed is not original
    finally:
        TokenizerManager._validate_one_request = original
