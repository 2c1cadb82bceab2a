"""Shared by the tiny-model tests in this process and those that run the CLI or a child."""

from __future__ import annotations

from pathlib import Path

import pytest

from banaserve.models import build_tiny_model

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def build_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model built for one test module (its ``tiny_dir`` fixture, module-scoped)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
