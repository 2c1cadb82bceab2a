"""A ``banaserve.launch_server`` process on the tiny model, and the limits the tests use."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import requests

from banaserve.utils.processes import ManagedProcess, free_port

SERVER_START_TIMEOUT = 300.0
#: Small enough that several servers fit beside each other on a CI machine.
TEST_KV_TOKENS = 16384
#: How long a test waits for a state it caused (a request queued, a claim held): only a bound
#: for a broken run, never a pace the test relies on, so generous for the slowest machine.
STATE_TIMEOUT = 120.0


class Server:
    """A ``banaserve.launch_server`` process: its URL, model and process (the caller stops it)."""

    def __init__(self, process: ManagedProcess, url: str, model_path: Path, name: str) -> None:
        self.process = process
        self.url = url
        self.model_path = model_path
        self.served_model_name = name

    def wait_ready(self) -> None:
        self.process.wait_http_ok(f"{self.url}/health", SERVER_START_TIMEOUT)

    def queue(self) -> tuple[int, int]:
        """(running, waiting) requests, as the instance's scheduler reports them (``/v1/loads``)."""
        loads = requests.get(f"{self.url}/v1/loads", params={"include": "core"}, timeout=30)
        loads.raise_for_status()
        ranks = loads.json()["loads"]
        return (sum(r["num_running_reqs"] for r in ranks),
                sum(r["num_waiting_reqs"] for r in ranks))  # fmt: skip

    def wait_queue(self, running: int, waiting: int, timeout: float = STATE_TIMEOUT) -> None:
        """Wait until the scheduler holds exactly ``running`` and ``waiting`` requests."""
        deadline = time.monotonic() + timeout
        while (seen := self.queue()) != (running, waiting):
            assert time.monotonic() < deadline, (
                f"{self.url}: (running, waiting) stayed {seen}, not {(running, waiting)}"
            )
            time.sleep(0.05)


def start_server(
    model: Path,
    log_path: Path,
    *extra_args: str,
    env: Mapping[str, str] | None = None,
    log_level: str = "warning",
) -> Server:
    """Start ``launch_server`` on the tiny model on a free port; not waited for (starting
    several at once overlaps their start-ups)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "banaserve.launch_server",
        "--model-path", str(model), "--port", str(port),
        "--max-total-tokens", str(TEST_KV_TOKENS), "--log-level", log_level,
        *extra_args,
    ]  # fmt: skip
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    process = ManagedProcess(log_path.stem, argv, log_path, env=env)
    return Server(process, f"http://127.0.0.1:{port}", model, model.name)
