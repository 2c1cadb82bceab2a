"""An aborted request's claims are released, end to end: a queued request aborted on a real
SGLang instance, and the request on another instance that needed its pages is timed.

The ledger itself is checked in process in ``unit/test_abort_release.py``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from banaserve.utils.processes import ManagedProcess
from support.kvstore_claims import Background
from support.kvstore_shards import TOKEN as SHARD_TOKEN
from support.kvstore_shards import start_shard
from support.servers import Server, start_server

# -- end to end --------------------------------------------------------------------------------

COALESCE_WAIT_S = 40.0


def prompt(seed: int) -> str:
    words = ["amber", "cobalt", "delta", "ember", "fjord", "granite", "hazel", "indigo"]
    return " ".join(words[(seed * 7 + i * i) % len(words)] + str(i % 13) for i in range(300))


@pytest.fixture(scope="module")
def one_slot_pair(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    """Two instances on one store: ``busy`` runs one request at a time (so another one waits
    in its queue, its pages claimed), ``other`` is free."""
    logs = tmp_path_factory.mktemp("abort-release")
    env = dict(os.environ, BANASERVE_KV_STORE_TOKEN=SHARD_TOKEN)
    processes: list[ManagedProcess] = []
    try:
        shard, url = start_shard(logs, "shard")
        processes.append(shard)
        store_args = ("--kv-store", url, "--kv-store-coalesce-wait-s", str(COALESCE_WAIT_S))
        busy = start_server(tiny_model, logs / "busy.log", *store_args,
                            "--max-running-requests", "1", env=env)  # fmt: skip
        other = start_server(tiny_model, logs / "other.log", *store_args, env=env)
        processes += [busy.process, other.process]
        busy.wait_ready()
        other.wait_ready()
        # SGLang JIT-builds its HiCache hash extension at a server's first storage lookup (about
        # 25 s when the build cache holds another checkout's build): not what is timed here.
        for server in (busy, other):
            generate(server, prompt(seed=99))
        yield busy, other
    finally:
        for process in reversed(processes):
            process.stop()


def generate(server: Server, text: str, rid: str | None = None, tokens: int = 4) -> dict:
    body: dict = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": tokens,
                                                    "ignore_eos": True}}  # fmt: skip
    if rid is not None:
        body["rid"] = rid
    return requests.post(f"{server.url}/generate", json=body, timeout=300).json()


def test_a_queued_request_aborted_does_not_hold_up_its_prefix(
    one_slot_pair: tuple[Server, Server],
) -> None:
    busy, other = one_slot_pair
    text = prompt(seed=11)
    # The only running slot of ``busy`` is taken by a long generation; ``queued`` waits
    # behind it with its pages claimed in the store, and is aborted there.
    long_run = threading.Thread(target=generate, args=(busy, "count: one two", None, 1500))
    long_run.start()
    time.sleep(1.0)
    queued = Background(lambda: generate(busy, text, rid="queued-1"))
    time.sleep(2.0)
    assert not queued.done(), "the queued request was not held behind the long one"
    abort = requests.post(f"{busy.url}/abort_request", json={"rid": "queued-1"}, timeout=30)
    assert abort.status_code == 200
    aborted = queued.result(timeout=60)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"

    started = time.monotonic()
    result = generate(other, text)
    elapsed = time.monotonic() - started
    assert len(result["output_ids"]) == 4
    # Without the release, ``other`` would wait COALESCE_WAIT_S for pages no one computes.
    assert elapsed < COALESCE_WAIT_S / 2, f"the prefix was held up {elapsed:.1f} s"
    long_run.join(timeout=300)
