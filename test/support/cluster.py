"""A running ``banaserve.cluster`` (gateway, instances, store) and requests to it."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from banaserve.env import ADMIN_TOKEN_ENV
from banaserve.utils.processes import ManagedProcess, free_port
from support.servers import SERVER_START_TIMEOUT, STATE_TIMEOUT, TEST_KV_TOKENS

#: The admin token of the clusters the tests start (BANASERVE_ADMIN_TOKEN).
ADMIN_TOKEN = "e2e-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_TOKENS}
VOCAB = ["river", "stone", "light", "quiet", "market", "window", "garden", "paper",
         "engine", "silver", "morning", "forest", "letter", "bridge", "harbour"]  # fmt: skip


@dataclass
class Cluster:
    process: ManagedProcess
    url: str
    log_dir: Path
    served_model_name: str

    def state(self) -> dict:
        answer = requests.get(f"{self.url}/cluster", headers=ADMIN, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def instance(self, name: str) -> dict:
        return next(i for i in self.state()["instances"] if i["name"] == name)

    def wait_idle(self) -> list[dict]:
        """Until no instance holds a request, as the instances report it (their reports lag
        the gateway's count), and the gateway books no owed tokens; the instances then."""
        deadline = time.monotonic() + STATE_TIMEOUT
        while True:
            instances = self.state()["instances"]
            if not any(i["inflight"] or i["load"]["running_reqs"] or i["load"]["queued_reqs"]
                       or i["load"].get("core_decode_tokens") for i in instances):  # fmt: skip
                return instances
            assert time.monotonic() < deadline, instances
            time.sleep(0.2)


@contextmanager
def running_cluster(
    model: Path, log_dir: Path, *extra_args: str, prefill: int = 2, decode: int = 1,
    store_gb: float = 0.5, env: dict[str, str] | None = None,
) -> Iterator[Cluster]:  # fmt: skip
    """``launch_server`` with ``prefill`` + ``decode`` instances of ``model``, pinned, until
    exit; ``env`` adds to the environment."""
    port = free_port()
    argv = [
        sys.executable, "-m", "banaserve.launch_server",
        "--model-path", str(model), "--num-prefill", str(prefill), "--num-decode", str(decode),
        "--port", str(port), "--max-total-tokens", str(TEST_KV_TOKENS),
        "--kv-store-capacity-gb", str(store_gb), "--cluster-log-dir", str(log_dir),
        "--cpu-affinity", *extra_args,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", **{ADMIN_TOKEN_ENV: ADMIN_TOKEN}, **(env or {}))
    process = ManagedProcess("cluster", argv, log_dir / "gateway.log", env=env)
    try:
        process.wait_http_ok(f"http://127.0.0.1:{port}/health", SERVER_START_TIMEOUT * 2)
        yield Cluster(process, f"http://127.0.0.1:{port}", log_dir, model.name)
    finally:
        process.stop(grace=60)


#: The instance restarts the supervisor runs here take 40-90 s each on 2 loaded cores.
RESTART_TIMEOUT_S = 240


def wait_all_running(cluster: Cluster) -> None:
    """Until every child runs (restarted ones too) and every instance is in routing."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        state = cluster.state()
        if all(s["state"] == "running" for s in state["supervisor"].values()) and all(
            i["load"]["healthy"] for i in state["instances"]
        ):
            return
        assert time.monotonic() < deadline, state["supervisor"]
        time.sleep(1)


def long_prompt(seed: int, words: int = 400) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(words))


def generate(url: str, text: str, **extra: object) -> dict:
    body = {"text": text, "sampling_params": GREEDY, **extra}
    answer = requests.post(f"{url}/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def streamed_generate(url: str, text: str, sampling_params: dict | None = None) -> str:
    """The text a streamed ``/generate`` of ``text`` ends with (greedy by default)."""
    body = {"text": text, "sampling_params": sampling_params or GREEDY, "stream": True}
    out = ""
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as answer:
        assert answer.status_code == 200, answer.text
        for line in answer.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                out = json.loads(line[5:])["text"]
    return out


def check_a_burst_computes_a_shared_prefix_once(
    cluster: Cluster, seed: int, *, every_request_hits: bool = True
) -> None:
    """8 requests sharing a new prefix at once, spread over the instances: the cluster
    computes the prefix once and (``every_request_hits``) every other request finds it cached.

    Which instances serve the direct requests is the router's choice (core-aware: in 2P+1D
    on two cores prefill-0 and decode-0 share core 0, so a burst may never reach prefill-0);
    what matters is that more than one instance served the prefix, so the bound below fails
    whenever each of them computes it itself."""
    prefix = long_prompt(seed=seed, words=500)
    prompts = [f"{prefix} question {i}: what comes next?" for i in range(8)]
    before = {i["name"]: i for i in cluster.state()["instances"]}
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: generate(cluster.url, p), prompts))
    after = {i["name"]: i for i in cluster.state()["instances"]}

    def delta(name: str, key: str) -> int:
        return after[name][key] - before[name][key]

    prompt_tokens = results[0]["meta_info"]["prompt_tokens"]
    served = [name for name in after if delta(name, "routed") >= 1]
    assert len(served) >= 2, after
    computed = sum(delta(name, "computed_prompt_tokens") for name in after)
    # Once the prefix (about prompt_tokens) plus each request's own tail (at most two pages
    # each, on the prefill and on the decode side): without coalescing, each prefill
    # instance would compute the prefix itself.
    assert computed < prompt_tokens + 2 * 2 * 16 * len(prompts), (computed, prompt_tokens, after)
    # Every request but the one that computed the prefix (a request of few output tokens runs
    # whole, never handed off) found it cached, on its instance or in the store. Whether a
    # lookup had to wait for the first one's pages (the store's "coalesced") depends on
    # timing: the gateway usually holds the others until that one answers.
    hits = [r["meta_info"]["cached_tokens"] for r in results]
    missed = [hit for hit in hits if hit < prompt_tokens - 2 * 16]
    assert not every_request_hits or len(missed) <= 1, (hits, prompt_tokens)
