"""Starting stock SGLang servers and sglang-router, as a user would: the pieces that the
colocated baseline (``coloc.py``) and stock PD (``stock_pd.py``) share.

Nothing of BanaServe runs in these processes except the CPU platform (``banaserve.platform``),
which the venv's ``.pth`` file applies to every Python process on a machine without an NVIDIA
driver.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

from banaserve.config.cli import CPU_DEFAULT_DTYPE  # noqa: E402
from banaserve.utils.processes import ChildFailed, ManagedProcess, free_port  # noqa: E402

#: Server flags for the CPU; the caller's flags come after them, so they can override any.
#: The dtype is BanaServe's CPU default, so a stock server answers as a BanaServe one does.
CPU_SERVER_ARGS = (
    "--device", "cpu",
    "--dtype", CPU_DEFAULT_DTYPE,
    "--max-total-tokens", "16384",
    "--sleep-on-idle",
    "--page-size", "16",
    "--log-level", "warning",
)  # fmt: skip

SERVER_START_TIMEOUT = 300.0
ROUTER_START_TIMEOUT = 120.0
ROUTER_START_ATTEMPTS = 3
PROGRESS_EVERY = 10.0


class ServerGroup:
    """Running SGLang servers and the router in front of them. ``url`` is the router's.

    The owner stops it (``stop()`` or ``with``); stopping is idempotent and stops every
    process by its process group, the router first.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.servers: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None
        #: The router's Prometheus metrics (per-worker counters), ``None`` when disabled.
        self.metrics_url: str | None = None

    @property
    def processes(self) -> list[ManagedProcess]:
        return ([self.router] if self.router is not None else []) + self.servers

    def stop(self) -> None:
        for process in self.processes:
            process.stop()

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_env(cores: tuple[int, ...] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(len(cores)) if cores else env.get("OMP_NUM_THREADS", "1")
    # The CPU platform sets these itself where there is no NVIDIA driver; harmless otherwise.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    return env


def pinned(argv: list[str], cores: tuple[int, ...] | None) -> list[str]:
    if not cores:
        return argv
    return ["taskset", "-c", ",".join(str(core) for core in cores), *argv]


def server_argv(model_path: str | Path, port: int, flags: Sequence[str]) -> list[str]:
    """``python -m sglang.launch_server`` on ``127.0.0.1:port`` with the CPU flags, then
    ``flags``."""
    return [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
        "--host", "127.0.0.1", "--port", str(port), *CPU_SERVER_ARGS, *flags,
    ]  # fmt: skip


def start_server(
    group: ServerGroup, name: str, argv: list[str], cores: tuple[int, ...] | None,
    log_dir: Path, env: dict[str, str] | None = None,
) -> ManagedProcess:  # fmt: skip
    """Start one server of ``group`` (pinned to ``cores``); it is stopped with the group."""
    process = ManagedProcess(
        name, pinned(argv, cores), log_dir / f"{name}.log", env={**server_env(cores), **(env or {})}
    )
    group.servers.append(process)
    return process


def wait_servers(group: ServerGroup, urls: Sequence[str], start_timeout: float) -> None:
    """Wait for every server's ``/health`` in turn (started together, their start-ups overlap)."""
    for process, url in zip(group.servers, urls, strict=True):
        took = process.wait_http_ok(f"{url}/health", start_timeout, PROGRESS_EVERY)
        print(f"[sglang] {process.name} healthy at {url} ({took:.0f} s)", file=sys.stderr)


def start_router(
    group: ServerGroup, port: int | None, router_argv: Callable[[int, int], list[str]],
    cores: tuple[int, ...] | None, log_dir: Path,
) -> None:  # fmt: skip
    """Start sglang-router, ``router_argv(port, metrics_port)``, and wait until it lists the
    model. ``port`` None: a free port, picked now (the servers open ports of their own while
    starting, so one picked earlier may be taken by then), and another one if it was taken
    anyway. Raises ``ChildFailed`` (quoting the log) if it dies or times out."""
    for attempt in range(1, ROUTER_START_ATTEMPTS + 1):
        router_port = port or free_port()
        group.url = f"http://127.0.0.1:{router_port}"
        if group.router is not None:
            group.router.stop()
        metrics_port = free_port()
        group.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        group.router = ManagedProcess(
            "router", pinned(router_argv(router_port, metrics_port), cores),
            log_dir / "router.log", env=server_env(cores),
        )  # fmt: skip
        try:
            took = group.router.wait_http_ok(
                f"{group.url}/health", ROUTER_START_TIMEOUT, PROGRESS_EVERY
            )
            break
        except ChildFailed as exc:
            taken = "Address already in use" in str(exc)
            if port is not None or not taken or attempt == ROUTER_START_ATTEMPTS:
                raise
            print(f"[sglang] router port {router_port} taken; again", file=sys.stderr)
    _wait_models(group, ROUTER_START_TIMEOUT)
    print(f"[sglang] router serving at {group.url} ({took:.0f} s)", file=sys.stderr)


#: What sglang-router probes to tell a live worker. SGLang's ``/health`` runs a one-token
#: generation that queues behind the batch, so a busy CPU worker fails it (timeout 5 s, three
#: in a row) and the router ejects it and answers 503: measured, coloc_2_cache_aware lost 88 of
#: cache pressure's 96 requests that way. ``/metrics`` answers under any load, and is what
#: BanaServe's gateway polls; a dead worker still fails it at once.
ROUTER_HEALTH_ENDPOINT = "/metrics"


def router_base_argv(port: int, metrics_port: int) -> list[str]:
    return [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-startup-check-interval", "1",
        "--health-check-endpoint", ROUTER_HEALTH_ENDPOINT,
    ]  # fmt: skip


def _wait_models(group: ServerGroup, timeout: float) -> None:
    """Wait until the router lists a model: then it has registered its workers."""
    assert group.router is not None
    deadline = time.monotonic() + timeout
    while True:
        if not group.router.alive():
            raise group.router.failure(f"exited with code {group.router.process.returncode}")
        try:
            with urllib.request.urlopen(f"{group.url}/v1/models", timeout=5) as response:
                if json.load(response).get("data"):
                    return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise group.router.failure(
                f"lists no model at {group.url}/v1/models after {timeout:.0f} s"
            )
        time.sleep(0.5)


def generate(url: str, payload: dict, timeout: float = 120.0) -> dict:
    """POST ``payload`` to ``url/generate``; the decoded JSON answer."""
    request = urllib.request.Request(
        f"{url}/generate",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)
