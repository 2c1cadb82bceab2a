"""A cluster that one bad request cannot take down (1 prefill + 1 decode of the tiny model).

Bad input is refused at the gateway and at every instance; a request that crashes its instance
anyway (fault injection: BANASERVE_TEST_CRASH_ON_TEXT makes the scheduler raise on it) costs
that one instance, which is restarted, and is then quarantined; a killed instance is
restarted while the other serves, three times, and leaves nothing behind; and a launcher
killed with SIGKILL leaves no process and no shared-memory file behind. The tests run in
file order: the last one kills the launcher.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from banaserve.cluster.leftovers import mapped_shm, recorded_shm, shm_files
from banaserve.env import CRASH_ON_TEXT_ENV
from support.cluster import (
    RESTART_TIMEOUT_S,
    Cluster,
    generate,
    running_cluster,
    wait_all_running,
)
from support.servers import Server

PILL = "POISON-PILL-FOR-THE-TEST"


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("supervised")
    with running_cluster(tiny_model, log_dir, prefill=1, decode=1, store_gb=0.25,
                         env={CRASH_ON_TEXT_ENV: PILL}) as running:  # fmt: skip
        yield running


def deaths(cluster: Cluster) -> dict[str, int]:
    return {name: s["deaths"] for name, s in cluster.state()["supervisor"].items()}


def wait_death_seen(cluster: Cluster, name: str, deaths_before: int) -> None:
    deadline = time.monotonic() + 60  # it looks every second; only a broken run waits long
    while cluster.state()["supervisor"][name]["deaths"] == deaths_before:
        assert time.monotonic() < deadline, cluster.state()["supervisor"]
        time.sleep(0.2)


def test_out_of_vocabulary_ids_are_refused_and_nothing_dies(cluster: Cluster) -> None:
    body = {"input_ids": [5, 99999999], "sampling_params": {"max_new_tokens": 4}}
    answer = requests.post(f"{cluster.url}/generate", json=body, timeout=60)
    assert answer.status_code == 400 and "99999999" in answer.json()["message"]
    # Each instance refuses it too, to a client that bypasses the gateway.
    for instance in cluster.state()["instances"]:
        direct = requests.post(f"{instance['url']}/generate", json=body, timeout=60)
        assert direct.status_code == 400 and "vocabulary" in direct.json()["message"]
    answer = requests.post(f"{cluster.url}/generate", data=json.dumps(body), timeout=60,
                           headers={"Content-Type": "text/plain"})  # fmt: skip
    assert answer.status_code == 415
    assert generate(cluster.url, "still serving")["text"]
    assert set(deaths(cluster).values()) == {0}


def test_a_poison_pill_costs_one_instance_and_is_then_refused(
    cluster: Cluster, server: Server
) -> None:
    body = {"text": f"{PILL} say something", "sampling_params": {"max_new_tokens": 4}}
    answer = requests.post(f"{cluster.url}/generate", json=body, timeout=RESTART_TIMEOUT_S * 2)
    assert answer.status_code == 500, answer.text
    message = answer.json()["message"]
    assert "second time" in message and "digest" in message
    # Tried on one instance, then on the same one restarted: the other never saw it.
    counts = deaths(cluster)
    assert sorted(counts.values()) == [0, 0, 2], counts
    again = requests.post(f"{cluster.url}/generate", json=body, timeout=60)
    assert again.status_code == 400 and "refused for another" in again.json()["message"]
    assert deaths(cluster) == counts
    wait_all_running(cluster)
    prompt = "The quick brown fox"
    assert generate(cluster.url, prompt)["output_ids"] == generate(server.url, prompt)["output_ids"]
    metrics = requests.get(f"{cluster.url}/metrics", timeout=30).text
    assert "banaserve_gateway_quarantined_total 1" in metrics
    assert 'banaserve_instance_restarts_total{instance="' in metrics


def orphan_shm_files(before: set[str]) -> set[str]:
    """Files in /dev/shm that were not there ``before`` and that no process maps or holds."""
    used = mapped_shm(int(p) for p in os.listdir("/proc") if p.isdigit())
    return {entry.name for entry in os.scandir("/dev/shm")
            if entry.name not in before and entry.stat().st_ino not in used}  # fmt: skip


def dead_rendezvous_runs() -> list[Path]:
    """Rendezvous folders (:mod:`banaserve.server.rendezvous`) of server runs that are gone."""
    return [p for p in Path(tempfile.gettempdir()).glob("banaserve-rendezvous-*-*")
            if not psutil.pid_exists(int(p.name.split("-")[2]))]  # fmt: skip


def test_a_killed_decode_instance_is_restarted_and_leaves_nothing(
    cluster: Cluster, server: Server
) -> None:
    """Three kill-restart cycles: each restart serves as before, and what the killed runs
    left in /dev/shm (SGLang's load snapshots and multiprocessing semaphores; one of each per
    run before issue 31's fix) and in their rendezvous folders is gone."""
    shm_before = set(os.listdir("/dev/shm"))
    prompt = "A river runs"
    expected = generate(server.url, prompt)["output_ids"]
    for cycle in range(3):
        state = cluster.state()
        decode = next(i for i in state["instances"] if i["role"] == "decode")
        before = state["supervisor"][decode["name"]]
        os.killpg(state["pids"][decode["name"]], signal.SIGKILL)
        # The prefill instance serves meanwhile; the decode one comes back.
        assert generate(cluster.url, prompt)["output_ids"] == expected
        wait_death_seen(cluster, decode["name"], before["deaths"])
        wait_all_running(cluster)
        report = cluster.state()["supervisor"][decode["name"]]
        assert report["restarts"] == before["restarts"] + 1
        assert report["last_death"]["crashed_by_itself"] is False  # a kill from outside
        assert generate(cluster.url, prompt)["output_ids"] == expected, cycle
    assert orphan_shm_files(shm_before) == set()
    # A run's rendezvous folder is removed by the next run when the first is killed.
    assert dead_rendezvous_runs() == []


def test_a_killed_store_is_back_once_it_proves_the_token(cluster: Cluster, server: Server) -> None:
    """The embedded store is restarted and counted back by a handshake with the cluster's
    token (a port that accepts may be another process's); the cluster serves as before."""
    name = "embedded KV store"
    state = cluster.state()
    before = state["supervisor"][name]
    os.kill(state["pids"][name], signal.SIGKILL)
    wait_death_seen(cluster, name, before["deaths"])
    wait_all_running(cluster)
    assert cluster.state()["supervisor"][name]["restarts"] == before["restarts"] + 1
    prompt = "Stores come back"
    assert generate(cluster.url, prompt)["output_ids"] == generate(server.url, prompt)["output_ids"]


def test_the_cluster_logs_are_readable_by_their_user_only(cluster: Cluster) -> None:
    """SGLang prints every server argument to its log, the admin token among them."""
    logs = sorted(cluster.log_dir.glob("*.log"))
    assert len(logs) >= 3, logs  # the instances' and the reaper's at least
    assert {log.name: stat.S_IMODE(log.stat().st_mode) for log in logs} == {
        log.name: 0o600 for log in logs
    }


def test_a_killed_launcher_leaves_nothing_behind(cluster: Cluster) -> None:
    shm = shm_files(recorded_shm(cluster.log_dir / "children.json"))
    assert any("sglang_loads" in p for p in shm), shm  # what SIGKILLed SGLang leaves
    launcher = psutil.Process(cluster.process.pid)
    children = launcher.children(recursive=True)
    assert len(children) >= 3
    cluster.process.process.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [c.cmdline() for c in alive]
    deadline = time.monotonic() + 60
    while any(Path(p).exists() for p in shm) or dead_rendezvous_runs():
        assert time.monotonic() < deadline, ([p for p in shm if Path(p).exists()],
                                             dead_rendezvous_runs())  # fmt: skip
        time.sleep(0.2)
