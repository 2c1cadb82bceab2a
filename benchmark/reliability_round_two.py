"""The reliability probes of hardening round two (issue 31), run by ``reliability.py`` against
its cluster after the bad-input probes:

- out-of-vocabulary ids on every route that generates (``PUT /generate``,
  ``/vertex_generate``, ``/v1/score``) to each instance: 400, nothing dies;
- requests bounded by value (``top_logprobs_num`` 2048, ``logit_bias`` 1e308): 400;
- six non-streaming clients that give up after 2 s: their requests are aborted on the
  instances (SGLang's abort counter), not generated to the end;
- admin calls without the admin token: 401; ``/cluster`` without it shows no process ids;
- decode-0's scheduler stopped (SIGSTOP): requests sent meanwhile are served elsewhere,
  decode-0 leaves routing and returns after SIGCONT;
- every socket the cluster's processes listen on is on loopback (torch.distributed's
  rendezvous included), and a request for another host name (DNS rebinding) gets 400 at
  the gateway and at each instance;
- a client whose request head or body never ends is cut off (closed; 408).
"""

from __future__ import annotations

import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests

from reliability import CLIENT_TIMEOUT_S, Cluster, Probe, prompt

OOV_BODIES = [
    ("PUT", "/generate", {"input_ids": [5, 99999999]}),
    ("POST", "/vertex_generate", {"instances": [{"input_ids": [5, 99999999]}]}),
    ("POST", "/v1/score", {"query": [5, 6], "items": [[5, 99999999]], "label_token_ids": [1, 2]}),
]
ABORTED = re.compile(r"^sglang:num_aborted_requests_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


def oov_routes_probe(cluster: Cluster) -> Probe:
    statuses = [
        requests.request(method, f"{i['url']}{path}", json=body, timeout=60).status_code
        for i in cluster.state()["instances"]
        for method, path, body in OOV_BODIES
    ]  # fmt: skip
    served = cluster.generate(prompt(41)).status_code == 200
    return Probe("oov_every_route", set(statuses) == {400} and served,
                 f"statuses {statuses}; served after: {served}")  # fmt: skip


def value_bounds_probe(cluster: Cluster) -> Probe:
    bodies = [{"text": "hi", "top_logprobs_num": 2048, "return_logprob": True},
              {"text": "hi", "sampling_params": {"logit_bias": {"5": 1e308}}}]  # fmt: skip
    statuses = [requests.post(f"{cluster.url}/generate", json=b, timeout=60).status_code
                for b in bodies]  # fmt: skip
    return Probe("bounded_by_value", statuses == [400, 400], f"statuses {statuses}")


def aborted(cluster: Cluster) -> float:
    total = 0.0
    for instance in cluster.state()["instances"]:
        text = requests.get(f"{instance['url']}/metrics", timeout=30).text
        total += sum(float(v) for v in ABORTED.findall(text))
    return total


def abandoned_clients_probe(cluster: Cluster, clients: int = 6) -> Probe:
    before = aborted(cluster)
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True}}

    def give_up(_: int) -> bool:
        try:
            requests.post(f"{cluster.url}/generate", json=body, timeout=2)
        except requests.Timeout:
            return True
        return False

    with ThreadPoolExecutor(clients) as pool:
        gave_up = sum(pool.map(give_up, range(clients)))
    deadline = time.monotonic() + 60
    while aborted(cluster) < before + gave_up and time.monotonic() < deadline:
        time.sleep(0.5)
    count = aborted(cluster) - before
    return Probe("abandoned_clients", gave_up == clients and count >= clients,
                 f"{gave_up} clients gave up after 2 s; {count:.0f} requests aborted")  # fmt: skip


def admin_probe(cluster: Cluster) -> Probe:
    statuses = [requests.post(f"{cluster.url}{path}", json={}, timeout=60).status_code
                for path in ("/clear_caches", "/flush_cache", "/migration")]  # fmt: skip
    shown = requests.get(f"{cluster.url}/cluster", timeout=60).json()
    hidden = "pids" not in shown and "pids" in cluster.state()
    return Probe("admin_needs_token", statuses == [401] * 3 and hidden,
                 f"without the token: {statuses}; /cluster hides pids: {hidden}")  # fmt: skip


def stuck_instance_probe(cluster: Cluster) -> Probe:
    instance = psutil.Process(cluster.state()["pids"]["decode-0"])
    scheduler = next(p for p in instance.children(recursive=True)
                     if "scheduler" in " ".join(p.cmdline()))  # fmt: skip
    long_output = {"temperature": 0.0, "max_new_tokens": 24}
    scheduler.suspend()
    try:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(
                lambda i: cluster.generate(prompt(50 + i), timeout=90,
                                           sampling_params=long_output), range(3)))  # fmt: skip
        stalls = next(i for i in cluster.state()["instances"] if i["name"] == "decode-0")["stalls"]
    finally:
        scheduler.resume()
    deadline = time.monotonic() + 120
    back = False
    while not back and time.monotonic() < deadline:
        decode = next(i for i in cluster.state()["instances"] if i["name"] == "decode-0")
        back = decode["load"]["healthy"]
        time.sleep(0.5)
    served = [a.status_code for a in answers]
    return Probe(
        "stuck_instance",
        served == [200] * 3 and stalls >= 1 and back,
        f"served {served} while decode-0 was stopped; stalls {stalls}; back {back}",
    )


def listeners_probe(cluster: Cluster) -> Probe:
    root = psutil.Process(cluster.launcher.pid)
    wide = sorted(
        f"{p.name()}:{c.laddr.ip}:{c.laddr.port}"
        for p in [root, *root.children(recursive=True)]
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.ip != "127.0.0.1"
    )  # fmt: skip
    return Probe("listeners_on_loopback", not wide, f"beyond loopback: {wide or 'none'}")


def host_header_probe(cluster: Cluster) -> Probe:
    urls = [cluster.url, *(i["url"] for i in cluster.state()["instances"])]
    statuses = [requests.post(f"{url}/generate", json={"text": "hi"}, timeout=60,
                              headers={"Host": "evil.example"}).status_code
                for url in urls]  # fmt: skip
    return Probe("host_header_checked", set(statuses) == {400},
                 f"Host: evil.example -> {statuses}")  # fmt: skip


def slow_client_probe(cluster: Cluster) -> Probe:
    """A head that never ends loses its connection, a body that never ends gets 408."""
    head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{cluster.port}\r\n"
            "Content-Type: application/json\r\n").encode()  # fmt: skip
    answers = []
    for sent in (head, head + b'Content-Length: 100\r\n\r\n{"text":'):
        with socket.create_connection(("127.0.0.1", cluster.port)) as conn:
            conn.settimeout(CLIENT_TIMEOUT_S * 6)
            conn.sendall(sent)
            try:
                answers.append(conn.recv(4096))  # until the gateway answers or closes
            except TimeoutError:
                answers.append(b"still open")
    served = cluster.generate(prompt(43)).status_code == 200
    ok = answers[0] == b"" and answers[1].startswith(b"HTTP/1.1 408") and served
    shown = [a.split(b"\r\n", 1)[0].decode(errors="replace") or "closed" for a in answers]
    return Probe("slow_clients_cut_off", ok, f"partial head, partial body -> {shown}; "
                 f"served after: {served}")  # fmt: skip


def round_two_probes(cluster: Cluster) -> list[Probe]:
    return [oov_routes_probe(cluster), value_bounds_probe(cluster),
            abandoned_clients_probe(cluster), admin_probe(cluster),
            stuck_instance_probe(cluster), listeners_probe(cluster),
            host_header_probe(cluster), slow_client_probe(cluster)]  # fmt: skip
