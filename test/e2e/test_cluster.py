"""A BanaServe cluster from one command: 2 prefill + 1 decode instances behind one port.

Greedy outputs equal those of one plain instance (the session ``server``) on every endpoint,
streaming included, whether a request goes through the prefill -> store -> decode handoff
(long prompts) or straight to the decode instance (short ones). A burst sharing a new prefix
computes it once in the whole cluster. A killed decode instance leaves routing and the
cluster keeps serving; SIGTERM stops every process. The tests run in file order: the last
two break the cluster on purpose.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from banaserve.launch_server import KV_STORE_PAGE_SIZE as PAGE
from banaserve.utils.processes import ManagedProcess, free_port, tail
from support.cluster import (
    ADMIN,
    GREEDY,
    MAX_TOKENS,
    Cluster,
    check_a_burst_computes_a_shared_prefix_once,
    generate,
    long_prompt,
    running_cluster,
    streamed_generate,
)
from support.servers import STATE_TIMEOUT, TEST_KV_TOKENS, Server


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Roles as walls: the kill test needs every long request decoding on decode-0 (the default,
    # long requests on spare prefill cores too, is test_cluster_linker's), and the handoff
    # tests every long prompt handed off, never spilled whole onto the idle decode-0.
    logs = tmp_path_factory.mktemp("cluster")
    walls = ("--serve-on-spare-prefill", "off", "--spill-prefill", "off")
    with running_cluster(tiny_model, logs, *walls) as running:
        yield running


def test_sigterm_during_start_up_stops_everything(tiny_model: Path, tmp_path: Path) -> None:
    import psutil

    argv = [
        sys.executable, "-m", "banaserve.launch_server", "--model-path", str(tiny_model),
        "--num-prefill", "1", "--num-decode", "1", "--port", str(free_port()),
        "--max-total-tokens", str(TEST_KV_TOKENS), "--cluster-log-dir", str(tmp_path),
    ]  # fmt: skip
    process = ManagedProcess("cluster", argv, tmp_path / "gateway.log")
    try:
        deadline = time.monotonic() + 120
        while "started decode-0" not in tail(process.log_path):
            assert process.alive() and time.monotonic() < deadline, tail(process.log_path)
            time.sleep(0.2)
        children = psutil.Process(process.pid).children(recursive=True)
        assert len(children) >= 3  # the store and two instances, at least
        process.process.send_signal(signal.SIGTERM)  # to the launcher only, mid start-up
        process.process.wait(timeout=90)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [c.cmdline() for c in alive]
    finally:
        process.stop()


def openai_client(url: str):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300)


#: More output tokens than ``--in-place-max-new-tokens``: a long prompt's request is handed off.
LONG_OUT = {**GREEDY, "max_new_tokens": 24}
CASES = [("The quick brown fox", GREEDY), (long_prompt(seed=101), LONG_OUT),
         (long_prompt(seed=102), GREEDY)]  # fmt: skip


@pytest.mark.parametrize(("prompt", "params"), CASES, ids=["short", "long", "long-prompt-only"])
def test_generate_matches_a_plain_instance(
    cluster: Cluster, server: Server, prompt: str, params: dict
) -> None:
    expected = generate(server.url, prompt, sampling_params=params)
    handoffs = cluster.state()["gateway"]["handoffs"]
    got = generate(cluster.url, prompt, sampling_params=params)
    assert got["output_ids"] == expected["output_ids"]
    assert streamed_generate(cluster.url, prompt, params) == expected["text"]
    handed_off = cluster.state()["gateway"]["handoffs"] - handoffs
    if params is LONG_OUT:
        # The long prompt went through a prefill instance, and the decode instance found its
        # pages in the store rather than computing them.
        assert handed_off >= 1
        details = got["meta_info"]["cached_tokens_details"] or {}
        assert details.get("storage", 0) + details.get("device", 0) >= 16 * 30, details
    else:
        # A request of few output tokens runs whole on one instance, however long its prompt.
        assert handed_off == 0


@pytest.mark.parametrize(("prompt", "params"), CASES[:2], ids=["short", "long"])
def test_openai_endpoints_match_a_plain_instance(
    cluster: Cluster, server: Server, prompt: str, params: dict
) -> None:
    name = cluster.served_model_name
    plain, ours = openai_client(server.url), openai_client(cluster.url)
    kwargs = {"model": name, "max_tokens": params["max_new_tokens"], "temperature": 0}
    expected = plain.completions.create(prompt=prompt, **kwargs).choices[0].text
    assert ours.completions.create(prompt=prompt, **kwargs).choices[0].text == expected
    stream = ours.completions.create(prompt=prompt, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected

    messages = [{"role": "user", "content": prompt}]
    expected = plain.chat.completions.create(messages=messages, **kwargs)
    got = ours.chat.completions.create(messages=messages, **kwargs)
    assert got.choices[0].message.content == expected.choices[0].message.content
    stream = ours.chat.completions.create(messages=messages, stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == expected.choices[0].message.content


def test_frontend_program_with_fork(cluster: Cluster) -> None:
    import sglang as sgl

    from support.frontend import CHOICES, describe

    backend = sgl.RuntimeEndpoint(cluster.url)
    state = describe.run(topic="the sea", backend=backend)
    assert state["colour"] in CHOICES
    assert len(state["ideas"]) == 2 and state["summary"]
    again = describe.run(topic="the sea", backend=backend)
    assert (again["colour"], again["ideas"], again["summary"]) == (
        state["colour"], state["ideas"], state["summary"],
    )  # fmt: skip


def test_bench_serving_runs_against_the_gateway(
    cluster: Cluster, tiny_model: Path, tmp_path: Path
) -> None:
    result_file = tmp_path / "bench.jsonl"
    argv = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
        "--base-url", cluster.url, "--model", str(tiny_model), "--tokenizer", str(tiny_model),
        "--dataset-name", "random-ids", "--num-prompts", "8", "--random-input-len", "300",
        "--random-output-len", "4", "--random-range-ratio", "1.0", "--max-concurrency", "4",
        "--output-file", str(result_file),
    ]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads(result_file.read_text().splitlines()[-1])
    assert result["completed"] == 8


def test_a_burst_computes_a_shared_prefix_once(cluster: Cluster) -> None:
    check_a_burst_computes_a_shared_prefix_once(cluster, seed=202)


def test_bad_input_gets_a_clear_error(cluster: Cluster) -> None:
    answer = requests.post(
        f"{cluster.url}/generate", data=b"{not json", timeout=30,
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    assert answer.status_code == 400 and "JSON" in answer.json()["message"]
    answer = requests.post(
        f"{cluster.url}/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert answer.status_code == 404 and "no-such-model" in answer.text
    answer = requests.post(
        f"{cluster.url}/v1/completions",
        json={"model": cluster.served_model_name, "prompt": long_prompt(5), "max_tokens": -1},
        timeout=30,
    )
    assert answer.status_code == 400 and "max_tokens" in answer.text
    assert generate(cluster.url, "still serving")["text"]


def test_cluster_and_metrics_report_every_instance(cluster: Cluster) -> None:
    state = cluster.state()
    assert state["policy"] == {"prefill": "load_aware", "decode": "load_aware"}
    names = sorted(i["name"] for i in state["instances"])
    assert names == ["decode-0", "prefill-0", "prefill-1"]
    for instance in state["instances"]:
        load = instance["load"]
        assert load["healthy"] and load["kv_capacity_tokens"] > 0, instance
    assert all(s["up"] for s in state["store"].values())
    metrics = requests.get(f"{cluster.url}/metrics", timeout=30).text
    for name in names:
        assert f'banaserve_instance_healthy{{instance="{name}"' in metrics
    assert "banaserve_gateway_handoffs_total" in metrics
    # The handoffs of the tests before: prefill instances wrote pages to the store and the
    # decode instance read them, and each instance's /metrics says how long that took.
    moved: dict[tuple[str, str, str], float] = {}
    for instance in state["instances"]:
        text = requests.get(f"{instance['url']}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("banaserve:kv_store_"):
                    key = (instance["role"], sample.name, sample.labels["op"])
                    moved[key] = moved.get(key, 0.0) + sample.value
    assert moved.get(("prefill", "banaserve:kv_store_bytes_total", "put"), 0) > 0, moved
    assert moved.get(("decode", "banaserve:kv_store_bytes_total", "get"), 0) > 0, moved
    assert moved.get(("decode", "banaserve:kv_store_seconds_total", "lookup"), 0) > 0, moved


def settled_store_pages(cluster: Cluster, quiet_s: float = 1.5, timeout: float = 60) -> int:
    """The store's page count once it stopped changing for ``quiet_s`` (instances write their
    pages back in the background after they answer)."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while True:
        pages = sum(shard["ram_pages"] for shard in cluster.state()["store"].values())
        if pages != last:
            last, since = pages, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return pages
        assert time.monotonic() < deadline, f"the store kept changing: {pages} pages"
        time.sleep(0.25)


def test_clear_caches_leaves_every_cache_cold(cluster: Cluster) -> None:
    prompt = long_prompt(seed=404)
    first = generate(cluster.url, prompt, sampling_params=LONG_OUT)
    assert settled_store_pages(cluster) > 0
    answer = requests.post(f"{cluster.url}/clear_caches", headers=ADMIN, timeout=120)
    assert answer.status_code == 200, answer.text
    counts = answer.json()
    assert counts["instances_flushed"] == 3, counts
    assert counts["store_pages_dropped"] > 0 and counts["prompt_index_chars_dropped"] >= len(prompt)
    state = cluster.state()
    for url, shard in state["store"].items():
        assert (shard["ram_pages"], shard["ssd_pages"], shard["ram_bytes"]) == (0, 0, 0), url
    before = {i["name"]: i for i in state["instances"]}
    again = generate(cluster.url, prompt, sampling_params=LONG_OUT)
    assert again["text"] == first["text"] and again["output_ids"] == first["output_ids"]
    after = cluster.state()
    # Cold everywhere: the gateway forgot the prompt (a handoff again) and the prefill
    # instance that took it computed it in full (neither its own cache nor the store had it).
    assert after["gateway"]["handoffs"] == state["gateway"]["handoffs"] + 1
    computed = sum(
        i["computed_prompt_tokens"] - before[i["name"]]["computed_prompt_tokens"]
        for i in after["instances"]
        if i["role"] == "prefill"
    )
    assert computed >= first["meta_info"]["prompt_tokens"] - 16, computed


def wait_for_store_pages(cluster: Cluster, pages: int) -> None:
    """Until the store holds at least ``pages`` pages (an instance writes a finished request's
    pages back after it answers)."""
    deadline = time.monotonic() + STATE_TIMEOUT
    while True:
        held = sum(shard["ram_pages"] for shard in cluster.state()["store"].values())
        if held >= pages:
            return
        assert time.monotonic() < deadline, f"the store holds {held} pages, not {pages}"
        time.sleep(0.25)


def generate_ids(url: str, ids: list[int], max_new_tokens: int) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    answer = requests.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params},
                           timeout=300)  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_next_turn_on_another_instance_loads_the_whole_previous_turn(
    cluster: Cluster, server: Server
) -> None:
    """Turn 1 runs on decode-0, which writes its prompt's and its generated tokens' pages to
    the store; turn 2 (turn 1's prompt, its answer and a new question) runs on prefill-1,
    which never saw turn 1, finds both in the store, and answers as one plain instance."""
    rng = random.Random(606)
    prompt = [rng.randrange(100, 2000) for _ in range(300)]
    question = [rng.randrange(100, 2000) for _ in range(20)]
    urls = {i["name"]: i["url"] for i in cluster.state()["instances"]}
    before = settled_store_pages(cluster)
    first = generate_ids(urls["decode-0"], prompt, 40)
    assert first["output_ids"] == generate_ids(server.url, prompt, 40)["output_ids"]
    # Page-aligned, all but the last generated token (it has no KV yet) are written back.
    written = (len(prompt) + len(first["output_ids"]) - 1) // PAGE * PAGE
    wait_for_store_pages(cluster, before + written // PAGE)
    turn = prompt + first["output_ids"] + question
    second = generate_ids(urls["prefill-1"], turn, 8)
    assert second["output_ids"] == generate_ids(server.url, turn, 8)["output_ids"]
    details = second["meta_info"]["cached_tokens_details"]
    assert details["device"] == 0 and details["storage"] >= written, details
    assert written > len(prompt) // PAGE * PAGE  # generated tokens' pages among them


def test_cluster_reports_what_a_chats_next_turn_found_cached(
    cluster: Cluster, server: Server
) -> None:
    name = cluster.served_model_name
    plain, ours = openai_client(server.url), openai_client(cluster.url)
    kwargs = {"model": name, "max_tokens": MAX_TOKENS, "temperature": 0}
    history = [{"role": "user", "content": long_prompt(seed=707, words=300)}]
    first = ours.chat.completions.create(messages=history, **kwargs)
    answer = first.choices[0].message.content
    assert (
        answer
        == plain.chat.completions.create(messages=history, **kwargs).choices[0].message.content
    )
    history += [{"role": "assistant", "content": answer},
                {"role": "user", "content": "And after that?"}]  # fmt: skip
    expected = plain.chat.completions.create(messages=history, **kwargs).choices[0]
    before = cluster.state()["gateway"]
    stream = ours.chat.completions.create(
        messages=history, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        expected.message.content
    )
    usage = chunks[-1].usage
    state = cluster.state()
    after = state["gateway"]

    def delta(key: str) -> int:
        return after[key] - before[key]

    assert (delta("follow_up_turns"), delta("follow_up_reported")) == (1, 1), after
    # What the client was told is what the gateway booked for the next turn.
    cached = usage.prompt_tokens_details.cached_tokens
    assert (delta("follow_up_prompt_tokens"), delta("follow_up_cached_tokens")) == (
        usage.prompt_tokens, cached,
    )  # fmt: skip
    # Turn 1's prompt at least was found (on the instance that ran it, or in the store).
    assert cached >= first.usage.prompt_tokens // PAGE * PAGE - PAGE, (cached, first.usage)
    assert state["multi_turn"]["follow_up_turns"] >= 1 and state["multi_turn"]["hit_rate"] > 0


def test_instances_are_pinned_to_their_own_cores(cluster: Cluster) -> None:
    import psutil

    state = cluster.state()
    available = sorted(os.sched_getaffinity(0))
    for instance in state["instances"]:
        cores = sorted(instance["cores"])
        assert cores and set(cores) <= set(available), instance
        process = psutil.Process(state["pids"][instance["name"]])
        for p in [process, *process.children(recursive=True)]:
            assert sorted(p.cpu_affinity()) == cores, (instance["name"], p.cmdline())
    if len(available) >= 2:  # the two prefill instances never share a core
        prefill = [set(i["cores"]) for i in state["instances"] if i["role"] == "prefill"]
        assert not prefill[0] & prefill[1]


#: Output tokens of the requests in flight when decode-0 is killed: far more than the kill takes
#: to land (it lands once all of them are decoding), within the tiny model's 2048 positions.
KILLED_MAX_TOKENS = 900


def test_a_killed_decode_instance_leaves_routing(cluster: Cluster, server: Server) -> None:
    """Requests decoding on decode-0 when it is SIGKILLed: a stream that already sent tokens
    ends with a clear error event; a request with nothing sent yet is retried on another
    instance and answered in full."""
    decode_pid = cluster.state()["pids"]["decode-0"]
    prompt = long_prompt(seed=303)
    expected = generate(server.url, prompt)["output_ids"]
    params = {**GREEDY, "max_new_tokens": KILLED_MAX_TOKENS, "ignore_eos": True}
    retries_before = cluster.state()["gateway"]["retries"]
    streaming = [threading.Event() for _ in range(2)]

    def streamed(i: int) -> tuple[int, list[bytes]]:
        body = {"text": f"{prompt} {i}", "sampling_params": params, "stream": True}
        events = []
        with requests.post(f"{cluster.url}/generate", json=body, stream=True,
                           timeout=300) as answer:  # fmt: skip
            for line in answer.iter_lines():
                if line.startswith(b"data: "):
                    events.append(line[len(b"data: ") :])
                    streaming[i].set()
        return answer.status_code, events

    def whole(i: int) -> requests.Response:
        body = {"text": f"{prompt} {i}", "sampling_params": params}
        return requests.post(f"{cluster.url}/generate", json=body, timeout=300)

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(streamed, i) for i in range(2)]
        wholes = [pool.submit(whole, i) for i in range(2, 4)]
        # The kill lands once all four are decoding on decode-0: both streams have sent
        # tokens, and the gateway counts all four in flight there (their prefill steps,
        # on the prefill instances, are over).
        assert all(event.wait(120) for event in streaming)
        deadline = time.monotonic() + 60
        while cluster.instance("decode-0")["inflight"] < 4:
            assert time.monotonic() < deadline, cluster.instance("decode-0")
            time.sleep(0.1)
        os.killpg(decode_pid, signal.SIGKILL)
        # It leaves routing within seconds (before the supervisor can have restarted it).
        deadline = time.monotonic() + 15
        while cluster.instance("decode-0")["load"]["healthy"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not cluster.instance("decode-0")["load"]["healthy"]
        stream_outcomes = [f.result(timeout=300) for f in streams]
        whole_outcomes = [f.result(timeout=300) for f in wholes]
    for status, events in stream_outcomes:
        assert status == 200
        assert len(events) >= 3 and events[-1] == b"[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "failed mid-stream" in error["message"], error
        tokens = json.loads(events[-3])["meta_info"]["completion_tokens"]
        assert 0 < tokens < KILLED_MAX_TOKENS
    for answer, i in zip(whole_outcomes, range(2, 4), strict=True):
        assert answer.status_code == 200, answer.text[:500]
        output = answer.json()["output_ids"]
        assert len(output) == KILLED_MAX_TOKENS
        # Served again from the start elsewhere: the plain instance's greedy tokens.
        plain = {"text": f"{prompt} {i}", "sampling_params": {**GREEDY, "ignore_eos": True}}
        reference = requests.post(f"{server.url}/generate", json=plain, timeout=300)
        assert output[:MAX_TOKENS] == reference.json()["output_ids"]
    # Each request that had sent nothing was retried once; a stream cannot be.
    assert cluster.state()["gateway"]["retries"] == retries_before + 2
    # The cluster keeps serving, with the same greedy output.
    assert generate(cluster.url, prompt)["output_ids"] == expected
    # The crash is reported, with the instance's last log lines (the monitor looks every second;
    # 60 s only bounds a broken run).
    deadline = time.monotonic() + 60

    def crash_reported() -> bool:
        lines = tail(cluster.process.log_path, 200).splitlines()
        return any("decode-0 (pid" in line and "exited with code" in line for line in lines)

    while not crash_reported():
        assert time.monotonic() < deadline, tail(cluster.process.log_path, 200)
        time.sleep(0.5)


def test_sigterm_stops_every_process(cluster: Cluster) -> None:
    import psutil

    children = psutil.Process(cluster.process.pid).children(recursive=True)
    assert len(children) >= 3
    cluster.process.process.send_signal(signal.SIGTERM)
    cluster.process.process.wait(timeout=90)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [c.cmdline() for c in alive]
