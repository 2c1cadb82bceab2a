"""Stock SGLang PD (prefill + decode over mooncake_tcp, sglang-router in front) runs on the
CPU through the platform hook and answers exactly like one plain instance."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from support.servers import Server


def _missing() -> list[str]:
    missing = []
    for module, source in (
        ("mooncake.engine", "pip mooncake-transfer-engine-non-cuda, Debian libibverbs1"),
        ("sglang_router.launch_router", "pip sglang-router"),
    ):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module} ({source}): {exc}")
    return missing


MISSING = _missing()
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"stock PD needs {'; '.join(MISSING)}")

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
SHORT = "The quick brown fox"
#: About 600 tokens with the tiny model's tokenizer: several pages, so KV moves in chunks.
LONG = " ".join(f"Sentence number {i} talks about apples, rivers and stars." for i in range(26))


@pytest.fixture(scope="module")
def stock_pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from stock_pd import start_stock_pd

    log_dir = tmp_path_factory.mktemp("stock_pd")
    with start_stock_pd(tiny_model, 1, 1, "round_robin", None, log_dir) as pd:
        yield pd


def generate(url: str, text: str) -> dict:
    response = requests.post(
        f"{url}/generate", json={"text": text, "sampling_params": GREEDY}, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
def test_stock_pd_matches_single_instance(stock_pd: object, server: Server, prompt: str) -> None:
    got = generate(stock_pd.url, prompt)  # type: ignore[attr-defined]
    expected = generate(server.url, prompt)
    assert got["meta_info"]["prompt_tokens"] == expected["meta_info"]["prompt_tokens"]
    if prompt is LONG:
        assert 450 <= got["meta_info"]["prompt_tokens"] <= 800
    assert got["output_ids"] == expected["output_ids"]
    assert len(got["output_ids"]) == GREEDY["max_new_tokens"]


def test_stock_pd_prefix_hit_matches_single_instance(stock_pd: object, server: Server) -> None:
    """A prompt whose prefix the prefill instance has cached: its KV is sent early (the
    overlap scheduler's ``maybe_send_cached_prefix_chunk``, patched by ``pd_cpu``)."""
    for prompt in (LONG, LONG + " And what about the moon?"):
        got = generate(stock_pd.url, prompt)  # type: ignore[attr-defined]
        assert got["output_ids"] == generate(server.url, prompt)["output_ids"]
    assert got["meta_info"].get("cached_tokens", 0) > 0, got["meta_info"]
