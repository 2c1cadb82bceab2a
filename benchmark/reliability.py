"""Reliability probes: what a hostile or careless client, a crash and an OOM kill do to a cluster.

Usage: ``python benchmark/reliability.py [--quick] [--model PATH] [--out DIR]``

One BanaServe cluster (2 prefill + 1 decode instances, pinned, of the tiny test model unless
``--model``) on two store shards this script starts (``--kv-store-replication 2``), and every
probe against it, the destructive ones last:

- bad input: out-of-vocabulary token ids (to the gateway and to each instance), a 50 MB body
  (with ``/health`` timed meanwhile), JSON nested 900 deep, a ``text/plain`` POST, ``n=2000``;
- a poison pill (``BANASERVE_TEST_CRASH_ON_TEXT`` makes a scheduler raise on it): it may cost
  one instance, which is restarted, then it is quarantined;
- 64 streaming clients that disconnect mid-stream: nothing stays in flight, no leak;
- a 5-minute soak at 8 concurrent requests (30 s with ``--quick``): RSS growth of every process;
- a store shard SIGKILLed under load: no request fails, greedy outputs unchanged;
- the decode instance SIGKILLed under 16 concurrent streams: every request ends within 60 s,
  later ones succeed, outputs unchanged, the instance is restarted;
- the launcher SIGKILLed: no process and no recorded shared-memory file left after 10 s;
- hardening round two (``reliability_round_two.py``): out-of-vocabulary ids on every
  generating route, bounds by value, clients that give up, admin calls without the token, a
  stopped scheduler;
- the store server's own probes (``store_probes.py``: hostile connections, oversized PUTs,
  binding and tokens, tenants).

Prints a table and ends with::

    reliability probes=N passed=N lost_requests=0 wrong_outputs=0 cluster_deaths=0 rss_growth_pct=…

``lost_requests`` counts requests that hung, were dropped without an answer, or failed where
the cluster had an instance to serve them; ``wrong_outputs`` greedy outputs that differ from
the cluster's own before any fault; ``cluster_deaths`` instance deaths no probe caused on
purpose; ``rss_growth_pct`` the largest RSS growth of one process tree over the soak.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from banaserve.cluster.leftovers import recorded_shm, shm_files  # noqa: E402
from banaserve.env import CRASH_ON_TEXT_ENV  # noqa: E402
from banaserve.utils.processes import ManagedProcess, free_port  # noqa: E402
from compare_systems import BENCH_ADMIN_TOKEN, banaserve_env  # noqa: E402

PILL = "RELIABILITY-POISON-PILL"
START_TIMEOUT_S = 900.0
RESTART_TIMEOUT_S = 300.0
#: The gateway's --client-header-timeout and --client-body-timeout here (60 s by default):
#: short, so that the slow-client probe waits seconds.
CLIENT_TIMEOUT_S = 5
GREEDY = {"temperature": 0.0, "max_new_tokens": 16}
WORDS = "river stone light quiet market window garden paper engine silver morning".split()


@dataclass
class Probe:
    name: str
    passed: bool
    detail: str
    lost: int = 0
    wrong: int = 0


@dataclass
class Tally:
    """What the probes saw across the run."""

    probes: list[Probe] = field(default_factory=list)
    expected_deaths: int = 0  # deaths the probes caused on purpose
    rss_growth_pct: float = float("nan")


def prompt(i: int, words: int = 60) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words)) + f" #{i}"


#: The clusters' admin (banaserve_env gives them this token): /cluster shows the pids to it.
ADMIN = {"Authorization": f"Bearer {BENCH_ADMIN_TOKEN}"}


class Cluster:
    """The cluster under test and its two store shards (this script owns all of them)."""

    def __init__(self, model: str, out: Path) -> None:
        token = os.urandom(16).hex()
        env = dict(banaserve_env(), BANASERVE_KV_STORE_TOKEN=token)
        self.shards = []
        for i in range(2):
            port = free_port()
            argv = [sys.executable, "-m", "banaserve.kvstore.server", "--port", str(port),
                    "--capacity-gb", "0.5"]  # fmt: skip
            shard = ManagedProcess(f"shard-{i}", argv, out / f"shard-{i}.log", env=env)
            shard.wait_tcp_open("127.0.0.1", port, 60)
            self.shards.append((shard, f"shm://127.0.0.1:{port}"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = out / "cluster"
        argv = [
            sys.executable, "-m", "banaserve.launch_server", "--model-path", model,
            "--num-prefill", "2", "--num-decode", "1", "--port", str(self.port),
            "--max-total-tokens", "16384", "--cluster-log-dir", str(self.log_dir),
            "--kv-store", ",".join(url for _, url in self.shards),
            "--kv-store-replication", "2", "--cpu-affinity",
            "--client-header-timeout", str(CLIENT_TIMEOUT_S),
            "--client-body-timeout", str(CLIENT_TIMEOUT_S),
        ]  # fmt: skip
        env = dict(env, OMP_NUM_THREADS="1", **{CRASH_ON_TEXT_ENV: PILL})
        self.launcher = ManagedProcess("cluster", argv, out / "gateway.log", env=env)
        self.launcher.wait_http_ok(f"{self.url}/health", START_TIMEOUT_S, progress_every=30)

    def state(self) -> dict:
        return requests.get(f"{self.url}/cluster", headers=ADMIN, timeout=60).json()

    def deaths(self) -> int:
        return sum(s["deaths"] for s in self.state()["supervisor"].values())

    def wait_all_running(self, timeout: float = RESTART_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if all(s["state"] == "running" for s in state["supervisor"].values()):
                return True
            time.sleep(1)
        return False

    def generate(self, text: str, timeout: float = 120, **extra: object) -> requests.Response:
        body = {"text": text, "sampling_params": GREEDY, **extra}
        return requests.post(f"{self.url}/generate", json=body, timeout=timeout)

    def stop(self) -> None:
        self.launcher.stop(grace=60)
        for shard, _ in self.shards:
            shard.stop()


def tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0


def health_while(
    work: Callable[[], requests.Response], url: str
) -> tuple[requests.Response, float]:
    """Run ``work`` while timing ``/health`` every 50 ms; return its answer and the worst wait."""
    worst, stop = [0.0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            requests.get(f"{url}/health", timeout=120)
            worst[0] = max(worst[0], time.perf_counter() - start)
            time.sleep(0.05)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        return work(), worst[0]
    finally:
        stop.set()
        thread.join()


def post_raw(url: str, data: bytes, content_type: str = "application/json") -> requests.Response:
    return requests.post(url, data=data, headers={"Content-Type": content_type}, timeout=300)


def bad_input_probes(cluster: Cluster) -> list[Probe]:
    out = []
    gen = f"{cluster.url}/generate"
    oov = json.dumps({"input_ids": [5, 99999999], "sampling_params": {"max_new_tokens": 4}})
    statuses = [post_raw(gen, oov.encode()).status_code]
    statuses += [post_raw(f"{i['url']}/generate", oov.encode()).status_code
                 for i in cluster.state()["instances"]]  # fmt: skip
    out.append(Probe("oov_token_ids", set(statuses) == {400}, f"statuses {statuses}"))
    before = tree_rss(cluster.launcher.pid)
    huge = json.dumps({"text": "lorem ipsum " * 4_400_000}).encode()
    answer, worst = health_while(lambda: post_raw(gen, huge), cluster.url)
    grown = (tree_rss(cluster.launcher.pid) - before) / 2**20
    out.append(Probe("body_50MB", answer.status_code == 413 and worst < 1.0,
                     f"{answer.status_code}, /health at worst {worst * 1000:.0f} ms, "
                     f"gateway +{grown:.0f} MiB"))  # fmt: skip
    deep = b'{"text": "x", "a": ' + b"[" * 900 + b"]" * 900 + b"}"
    answer = post_raw(gen, deep)
    out.append(Probe("json_900_deep", answer.status_code == 400, answer.text[:90]))
    answer = post_raw(gen, b'{"text": "hi"}', "text/plain")
    out.append(Probe("text_plain_post", answer.status_code == 415, answer.text[:90]))
    body = {"model": "x", "prompt": "hi", "n": 2000, "max_tokens": 4}
    answer = requests.post(f"{cluster.url}/v1/completions", json=body, timeout=60)
    out.append(Probe("n_2000", answer.status_code == 400, answer.text[:90]))
    return out


def poison_probe(cluster: Cluster, tally: Tally) -> Probe:
    before = {n: s["deaths"] for n, s in cluster.state()["supervisor"].items()}
    answer = cluster.generate(f"{PILL} hello", timeout=RESTART_TIMEOUT_S * 2)
    again = cluster.generate(f"{PILL} hello", timeout=60)
    after = {n: s["deaths"] for n, s in cluster.state()["supervisor"].items()}
    hit = [n for n in after if after[n] > before[n]]
    tally.expected_deaths += sum(after[n] - before[n] for n in hit)
    back = cluster.wait_all_running()
    passed = answer.status_code == 500 and again.status_code == 400 and len(hit) == 1 and back
    return Probe("poison_pill", passed, f"{answer.status_code} then {again.status_code}; "
                 f"instances hit {hit}; restarted {back}")  # fmt: skip


def disconnect_probe(cluster: Cluster, clients: int) -> Probe:
    before_rss = tree_rss(cluster.launcher.pid)

    def leave_mid_stream(i: int) -> bool:
        body = {"text": prompt(i), "stream": True,
                "sampling_params": {"max_new_tokens": 512, "ignore_eos": True}}  # fmt: skip
        with requests.post(f"{cluster.url}/generate", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(b"data:"):
                    return True  # leaving the block closes the connection mid-stream
        return False

    with ThreadPoolExecutor(clients) as pool:
        started = sum(pool.map(leave_mid_stream, range(clients)))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        instances = cluster.state()["instances"]
        busy = sum(i["inflight"] + i["load"]["running_reqs"] + i["load"]["queued_reqs"]
                   for i in instances)  # fmt: skip
        if busy == 0:
            break
        time.sleep(1)
    grown = (tree_rss(cluster.launcher.pid) - before_rss) / 2**20
    served = cluster.generate(prompt(999)).status_code == 200
    return Probe("disconnecting_streams", busy == 0 and served and started == clients,
                 f"{started}/{clients} streams left mid-way; {busy} still busy; gateway "
                 f"+{grown:.0f} MiB")  # fmt: skip


def soak_probe(cluster: Cluster, seconds: float, references: dict[str, list[int]],
               tally: Tally) -> Probe:  # fmt: skip
    pids = {"gateway": cluster.launcher.pid, **cluster.state()["pids"]}
    pids |= {name: shard.pid for name, (shard, _) in zip(("shard-0", "shard-1"),
                                                         cluster.shards, strict=True)}  # fmt: skip
    start_rss = {name: tree_rss(pid) for name, pid in pids.items()}
    counts = {"ok": 0, "failed": 0, "wrong": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def worker(w: int) -> None:
        i = w
        while time.monotonic() < deadline:
            text = list(references)[i % len(references)]
            try:
                answer = cluster.generate(text)
                ok = answer.status_code == 200
            except requests.RequestException:
                ok = False
            wrong = ok and answer.json()["output_ids"] != references[text]
            with lock:
                counts["ok" if ok else "failed"] += 1
                counts["wrong"] += wrong
            i += 8

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(worker, range(8)))
    growth = {n: 100 * (tree_rss(pids[n]) - start_rss[n]) / max(1, start_rss[n]) for n in pids}
    tally.rss_growth_pct = max(growth.values())
    worst = max(growth, key=lambda n: growth[n])
    return Probe("soak", counts["failed"] == 0 and counts["wrong"] == 0,
                 f"{counts['ok']} served in {seconds:.0f} s, {counts['failed']} failed; RSS "
                 f"growth at most {tally.rss_growth_pct:.1f}% ({worst})",
                 lost=counts["failed"], wrong=counts["wrong"])  # fmt: skip


@dataclass
class LoadOutcome:
    """How the requests of :func:`under_load` ended."""

    ok: int = 0
    errors: int = 0  # a clear error: a 5xx, or a stream that ended with an error event
    lost: int = 0  # no answer in time, or the connection dropped
    wrong: int = 0
    slowest_s: float = 0.0


def under_load(cluster: Cluster, references: dict[str, list[int]], fault: Callable[[], None],
               streams: bool, concurrency: int) -> LoadOutcome:  # fmt: skip
    """Run the reference prompts ``concurrency`` at a time and ``fault()`` once they are
    under way; every request must end within 90 s."""
    texts = [list(references)[i % len(references)] for i in range(concurrency)]
    outcome = LoadOutcome()
    lock = threading.Lock()

    def one(text: str) -> None:
        start = time.monotonic()
        kind = "lost"
        try:
            answer = cluster.generate(text, timeout=90, stream=streams)
            if answer.status_code != 200:
                kind = "errors"
            elif streams:
                events = [json.loads(line[5:]) for line in answer.text.splitlines()
                          if line.startswith("data: {")]  # fmt: skip
                if not events or "error" in events[-1]:
                    kind = "errors"
                else:
                    kind = "ok" if events[-1]["output_ids"] == references[text] else "wrong"
            else:
                kind = "ok" if answer.json()["output_ids"] == references[text] else "wrong"
        except requests.RequestException:
            pass
        with lock:
            setattr(outcome, kind, getattr(outcome, kind) + 1)
            outcome.slowest_s = max(outcome.slowest_s, time.monotonic() - start)

    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one, t) for t in texts]
        time.sleep(1.0)
        fault()
        for future in futures:
            future.result()
    return outcome


def shard_kill_probe(cluster: Cluster, references: dict[str, list[int]]) -> Probe:
    shard = cluster.shards[0][0]
    got = under_load(cluster, references, lambda: os.killpg(shard.pid, signal.SIGKILL),
                     streams=False, concurrency=8)  # fmt: skip
    passed = got.ok == 8
    return Probe("store_shard_sigkill_r2", passed,
                 f"{got.ok}/8 served, {got.errors} errors, {got.wrong} wrong",
                 lost=got.lost + got.errors, wrong=got.wrong)  # fmt: skip


def decode_kill_probe(cluster: Cluster, references: dict[str, list[int]], tally: Tally) -> Probe:
    state = cluster.state()
    pid, deaths = state["pids"]["decode-0"], state["supervisor"]["decode-0"]["deaths"]
    got = under_load(cluster, references, lambda: os.killpg(pid, signal.SIGKILL),
                     streams=True, concurrency=16)  # fmt: skip
    tally.expected_deaths += 1
    deadline = time.monotonic() + 15  # the supervisor looks every second
    while cluster.state()["supervisor"]["decode-0"]["deaths"] == deaths:
        if time.monotonic() > deadline:
            return Probe("decode_sigkill_16_streams", False, "the death was never reported")
        time.sleep(0.2)
    later = [cluster.generate(text) for text in list(references)[:4]]
    later_ok = all(a.status_code == 200 for a in later)
    later_wrong = sum(a.status_code == 200 and a.json()["output_ids"] != references[t]
                      for a, t in zip(later, references, strict=False))  # fmt: skip
    back = cluster.wait_all_running()
    passed = got.lost == 0 and got.wrong == 0 and got.slowest_s <= 60 and later_ok and back
    return Probe("decode_sigkill_16_streams", passed and not later_wrong,
                 f"{got.ok} served, {got.errors} ended with an error, slowest "
                 f"{got.slowest_s:.0f} s; later requests ok {later_ok}; restarted {back}",
                 lost=got.lost + (not later_ok), wrong=got.wrong + later_wrong)  # fmt: skip


def launcher_kill_probe(cluster: Cluster) -> Probe:
    files = shm_files(recorded_shm(cluster.log_dir / "children.json"))
    children = psutil.Process(cluster.launcher.pid).children(recursive=True)
    os.kill(cluster.launcher.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(children, timeout=10)
    time.sleep(0.5)
    left = [p for p in files if Path(p).exists()]
    return Probe("launcher_sigkill", not alive and not left,
                 f"{len(children)} processes, {len(alive)} alive after 10 s; "
                 f"{len(files)} shm files, {len(left)} left")  # fmt: skip


def summary_line(tally: Tally, deaths: int) -> str:
    probes = tally.probes
    return (
        f"reliability probes={len(probes)} passed={sum(p.passed for p in probes)} "
        f"lost_requests={sum(p.lost for p in probes)} wrong_outputs={sum(p.wrong for p in probes)} "
        f"cluster_deaths={max(0, deaths - tally.expected_deaths)} "
        f"rss_growth_pct={tally.rss_growth_pct:.1f}"
    )


def guarded(tally: Tally, name: str, probe: Callable[[], Probe | list[Probe]]) -> None:
    """Run one probe; one that raises is a failed probe, and the next ones still run."""
    print(f"[reliability] {name} ...", flush=True)
    try:
        got = probe()
    except Exception as exc:  # noqa: BLE001 - a broken probe is a result, not the end
        got = Probe(name, False, f"raised {exc!r}")
    for row in got if isinstance(got, list) else [got]:
        tally.probes.append(row)
        print(f"[reliability]   {'PASS' if row.passed else 'FAIL'} {row.name}: {row.detail}",
              flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 30 s soak, 16 disconnects")
    parser.add_argument("--model", default=None, help="model folder (default: the tiny one)")
    parser.add_argument("--out", default=None, help="folder for logs (default: a temp one)")
    args = parser.parse_args()
    out = Path(args.out or f"/tmp/banaserve-reliability-{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from banaserve.models import ensure_tiny_model

        model = str(ensure_tiny_model(out / "tiny-llama"))
    print(f"[reliability] logs in {out}; load average {os.getloadavg()}", flush=True)
    tally = Tally()
    cluster = Cluster(model, out)
    deaths = 0
    try:
        references = {}
        for i in range(4):
            answer = cluster.generate(prompt(i, words=300))  # long: through the handoff
            answer.raise_for_status()
            references[prompt(i, words=300)] = answer.json()["output_ids"]
        guarded(tally, "bad input", lambda: bad_input_probes(cluster))
        from reliability_round_two import round_two_probes

        guarded(tally, "round two", lambda: round_two_probes(cluster))
        guarded(tally, "poison pill", lambda: poison_probe(cluster, tally))
        guarded(tally, "disconnects", lambda: disconnect_probe(cluster, 16 if args.quick else 64))
        guarded(tally, "soak", lambda: soak_probe(cluster, 30 if args.quick else 300,
                                                  references, tally))  # fmt: skip
        guarded(tally, "store shard kill", lambda: shard_kill_probe(cluster, references))
        guarded(tally, "decode kill", lambda: decode_kill_probe(cluster, references, tally))
        deaths = cluster.deaths()
        guarded(tally, "launcher kill", lambda: launcher_kill_probe(cluster))
    finally:
        cluster.stop()
    from store_probes import run_store_probes

    guarded(tally, "store", lambda: [Probe(r["probe"], r["passed"], r["detail"])
                                     for r in run_store_probes(out / "store")])  # fmt: skip
    width = max(len(p.name) for p in tally.probes)
    print(f"\n{'probe':<{width}}  result  detail")
    for p in tally.probes:
        print(f"{p.name:<{width}}  {'PASS' if p.passed else 'FAIL':<6}  {p.detail}")
    print(f"load average {os.getloadavg()}")
    print(summary_line(tally, deaths))


if __name__ == "__main__":
    main()
