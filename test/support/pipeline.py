"""The layouts of the pipeline-split tests' servers (``deep_model`` and ``pp_servers`` in
``test/conftest.py``): a plain instance of an 8-layer tiny model, the same model split at a
fixed boundary, and split with a movable one, and the requests they send."""

from __future__ import annotations

import json
from collections.abc import Callable

import requests

LAYERS = 8
#: The fixed split's boundary.
BOUNDARY = 3
#: The fixed split's KV pool: large enough that each stage's K size, which SGLang logs in GiB
#: with two decimals, tells 3 layers from 4 or 5 (16 MiB of K per layer of the tiny model).
SPLIT_KV_TOKENS = 65536
#: The movable split starts at this boundary and may move down to MIN_BOUNDARY.
MOVABLE_START = 6
MIN_BOUNDARY = 2


def generate(url: str, sampling: dict, text: str | list[str]) -> dict | list[dict]:
    """``/generate`` of ``text`` (one prompt or a batch) with ``sampling``; must answer 200."""
    response = requests.post(
        f"{url}/generate", json={"text": text, "sampling_params": sampling}, timeout=300
    )
    assert response.status_code == 200, response.text
    return response.json()


def streamed(
    url: str, sampling: dict, text: str, on_chunk: Callable[[int], None] | None = None
) -> tuple[list[int], str, int]:
    """The output ids and text a streamed ``/generate`` ends with, and how many chunks came;
    ``on_chunk`` is called with each chunk's number as it arrives."""
    body = {"text": text, "sampling_params": sampling, "stream": True}
    last, chunks = None, 0
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as answer:
        assert answer.status_code == 200, answer.text
        for line in answer.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                last, chunks = json.loads(line[5:]), chunks + 1
                if on_chunk is not None:
                    on_chunk(chunks)
    assert last is not None
    return last["output_ids"], last["text"], chunks
