"""A server on the tiny model answers like SGLang in-process, on every endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from support.servers import TEST_KV_TOKENS, Server
from support.stages import listening_sockets, not_on_loopback

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
]
MAX_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_TOKENS}


@dataclass(frozen=True)
class Reference:
    """Greedy texts from SGLang's ``sgl.Engine`` on the same model, per prompt."""

    completion: dict[str, str]
    chat: dict[str, str]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Reference:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    chat_ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for prompt in PROMPTS
    ]
    job = {
        "model_path": str(tiny_model),
        "max_total_tokens": TEST_KV_TOKENS,
        "sampling_params": GREEDY,
        "inputs": [{"prompt": p} for p in PROMPTS] + [{"input_ids": i} for i in chat_ids],
    }
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("reference_engine.py"))],
        input=json.dumps(job), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [line for line in run.stdout.splitlines() if line.startswith("REFERENCE ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    texts = json.loads(lines[-1].removeprefix("REFERENCE "))
    n = len(PROMPTS)
    return Reference(
        dict(zip(PROMPTS, texts[:n], strict=True)), dict(zip(PROMPTS, texts[n:], strict=True))
    )


def openai_client(server: Server):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_generate_matches_engine(server: Server, reference: Reference, prompt: str) -> None:
    answer = requests.post(
        f"{server.url}/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["text"] == reference.completion[prompt]


def test_generate_streaming_matches_engine(server: Server, reference: Reference) -> None:
    prompt = PROMPTS[1]
    body = {"text": prompt, "sampling_params": GREEDY, "stream": True}
    text = ""
    with requests.post(f"{server.url}/generate", json=body, stream=True, timeout=60) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                text = json.loads(line[5:])["text"]  # each chunk carries the text so far
    assert text == reference.completion[prompt]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_match_engine(server: Server, reference: Reference, prompt: str) -> None:
    client = openai_client(server)
    result = client.completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    assert result.choices[0].text == reference.completion[prompt]

    stream = client.completions.create(
        model=server.served_model_name,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == (
        result.choices[0].text
    )


@pytest.mark.parametrize("prompt", PROMPTS)
def test_chat_matches_engine(server: Server, reference: Reference, prompt: str) -> None:
    client = openai_client(server)
    messages = [{"role": "user", "content": prompt}]
    result = client.chat.completions.create(
        model=server.served_model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    expected = reference.chat[prompt]
    assert result.choices[0].message.content == expected

    stream = client.chat.completions.create(
        model=server.served_model_name,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == expected


def test_every_listener_binds_loopback(server: Server) -> None:
    """One server started on loopback listens on loopback only, torch.distributed's rendezvous
    included (before issue 31's fix its TCPStore listened on ``*:PORT``)."""
    listeners = listening_sockets(server.process.pid)
    assert listeners, "the server listens on nothing?"
    assert not_on_loopback(listeners) == {}


def test_other_host_names_are_refused(server: Server) -> None:
    """DNS rebinding (issue 31): a page whose name resolves to 127.0.0.1 reaches a loopback
    server with its own name in the Host header. Before, any Host was served."""
    port = server.url.rsplit(":", 1)[1]
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
    for host, status in ((f"evil.example:{port}", 400), (f"localhost:{port}", 200)):
        answer = requests.post(f"{server.url}/generate", json=body, headers={"Host": host},
                               timeout=60)  # fmt: skip
        assert answer.status_code == status, (host, answer.text)
    refused = requests.get(f"{server.url}/v1/models", headers={"Host": "evil.example"}, timeout=30)
    assert refused.status_code == 400 and "evil.example" in refused.json()["message"]


def test_health_models_and_metrics(server: Server) -> None:
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    models = requests.get(f"{server.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [server.served_model_name]
    metrics = requests.get(f"{server.url}/metrics", timeout=10)
    assert metrics.status_code == 200
    assert "sglang:" in metrics.text
