"""Tests of banaserve.models in process: the tiny test model, its tokenizer, atomic output
directories and the cache.

The CLI, a child process and (if installed and affordable, about 25 s) the SmolLM2 GGUF
conversion are ``e2e/test_models_cli_and_smollm2.py``.
"""

from __future__ import annotations

import filecmp
import os
import threading
import time
from pathlib import Path

import pytest

from banaserve.models import OutputExistsError, build_tiny_model, cache, ensure_tiny_model
from banaserve.models.atomic import atomic_output_dir
from support.models import (
    MODEL_FILES,
    build_tiny_dir,
)

tiny_dir = pytest.fixture(scope="module")(build_tiny_dir)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def test_tiny_build_writes_all_files(tiny_dir):
    assert sorted(p.name for p in tiny_dir.iterdir()) == sorted(MODEL_FILES)
    assert not list(tiny_dir.parent.glob("model.tmp-*"))


def test_tiny_build_is_deterministic(tiny_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    for name in MODEL_FILES:
        assert filecmp.cmp(tiny_dir / name, again / name, shallow=False), name


def test_tiny_loads_and_generates(tiny_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert (config.hidden_size, config.num_hidden_layers) == (128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == len(tokenizer) == 2048
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id

    outputs = []
    for prompt in ("Hello! How are you today?", "The cat sat on the mat.", "1, 2, 3, 4"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()
        assert len(new) == 8 and new[0] != tokenizer.eos_token_id
        outputs.append(new)
    # Random weights, but not degenerate: different prompts give different continuations.
    assert len({tuple(o) for o in outputs}) == len(outputs)


def test_tiny_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Spain?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nAnd of Spain?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5
    with pytest.raises(Exception, match="Unknown role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "  leading spaces, tabs\tand\nnew lines  ",
        "Unicode: héllo wörld, 東京, emoji 🙂, numbers 12345.",
        "",
    ],
)
def test_tiny_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < len(tokenizer) for i in ids)


def test_tiny_tokenizer_special_tokens(tokenizer):
    assert tokenizer.bos_token == "<|endoftext|>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    # Special tokens are single ids, and plain text never produces them.
    assert tokenizer("<|im_end|>", add_special_tokens=False).input_ids == [tokenizer.eos_token_id]
    assert tokenizer.eos_token_id not in tokenizer("im_end |> <| im").input_ids


def test_atomic_output_dir_failure_leaves_nothing(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError), atomic_output_dir(out) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_dir_refuses_non_empty(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "x").write_text("x")
    with pytest.raises(OutputExistsError), atomic_output_dir(tmp_path / "model"):
        pass


def _fake_builder(calls: list[str]):
    """A stand-in for a slow builder that records calls and writes a complete folder."""

    def build(out, **kwargs):
        calls.append(str(out))
        time.sleep(0.3)  # long enough for the other threads to queue on the lock
        with atomic_output_dir(Path(out), force=kwargs.get("force", False)) as tmp:
            for name in cache._REQUIRED_FILES:
                (tmp / name).write_text("x")
        return out

    return build


def _run_concurrently(fn, n: int = 3) -> list:
    results: list = [None] * n

    def run(i: int) -> None:
        results[i] = fn()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_default_model_path_converts_once(tmp_path, monkeypatch, capsys):
    import banaserve.models.smollm2 as smollm2

    calls: list[str] = []
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(smollm2, "convert_smollm2", _fake_builder(calls))

    paths = _run_concurrently(cache.default_model_path)
    expected = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert paths == [expected] * 3
    assert calls == [str(expected)]
    assert "converting SmolLM2-135M-Instruct" in capsys.readouterr().err
    assert cache.default_model_path() == expected  # cached: no new call
    assert len(calls) == 1


def test_ensure_tiny_model_builds_once(tmp_path, monkeypatch):
    import banaserve.models.tiny as tiny

    calls: list[str] = []
    monkeypatch.setattr(tiny, "build_tiny_model", _fake_builder(calls))
    paths = _run_concurrently(lambda: ensure_tiny_model(tmp_path / "tiny"))
    assert paths == [tmp_path / "tiny"] * 3
    assert len(calls) == 1


def test_cache_dir_default(monkeypatch):
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    assert cache.cache_dir() == Path.home() / ".cache" / "banaserve"
