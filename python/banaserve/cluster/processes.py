"""The cluster's child processes: the embedded store shard and the SGLang instances.

Every child is a :class:`~banaserve.utils.processes.ManagedProcess` in its own process group
with its own log file, so stopping one stops whatever it spawned, and it dies with the
launcher.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from banaserve.cluster.topology import InstanceSpec
from banaserve.utils.processes import ChildFailed, ManagedProcess

logger = logging.getLogger("banaserve.cluster")

#: SGLang takes 25-40 s to start on these machines, several at once on 2 cores much longer.
START_TIMEOUT_S = 600.0
PROGRESS_EVERY_S = 15.0
WAITING_CALL_EVERY_S = 5.0


@dataclass
class Child:
    """A child of the cluster: an SGLang instance (``spec`` set) or the embedded store.
    ``process`` is its current run, owned by :class:`ClusterProcesses`; the supervisor
    replaces it when it restarts the child."""

    name: str
    process: ManagedProcess
    spec: InstanceSpec | None = None

    @property
    def url(self) -> str | None:
        return self.spec.url if self.spec is not None else None


def instance_argv(spec: InstanceSpec, launch_argv: Sequence[str]) -> list[str]:
    """``launch_server`` for one instance, pinned with ``taskset`` when it has cores."""
    argv = [
        sys.executable, "-m", "banaserve.launch_server", *launch_argv,
        "--host", "127.0.0.1", "--port", str(spec.port), *spec.args,
    ]  # fmt: skip
    if spec.cores:
        argv = ["taskset", "-c", ",".join(map(str, spec.cores)), *argv]
    return argv


def instance_env(spec: InstanceSpec, base: dict[str, str]) -> dict[str, str]:
    env = dict(base, **dict(spec.env))
    if spec.cores and "OMP_NUM_THREADS" not in base:
        # torch starts one thread per visible core otherwise, and pinned cores are few.
        env["OMP_NUM_THREADS"] = str(len(spec.cores))
    return env


class ClusterProcesses:
    """Starts and stops the instances (and the store process, when given).

    Start-up runs in the caller's thread, which must outlive the children (they die with the
    thread that started them; see :class:`ManagedProcess`). Watching and restarting them is
    :class:`~banaserve.cluster.supervisor.Supervisor`'s. Stop is idempotent: instances
    first (in parallel), then the store.
    """

    def __init__(self, log_dir: Path, store: ManagedProcess | None = None) -> None:
        self.log_dir = log_dir
        self.store = Child(store.name, store) if store is not None else None
        self.instances: list[Child] = []
        self._launch_argv: list[str] = []
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def children(self) -> list[Child]:
        return self.instances + ([self.store] if self.store is not None else [])

    @property
    def stopped(self) -> bool:
        return self._stopped

    def start(
        self,
        specs: Sequence[InstanceSpec],
        launch_argv: Sequence[str],
        env: dict[str, str],
        timeout: float = START_TIMEOUT_S,
        on_started: Callable[[Child], None] | None = None,
        while_waiting: Callable[[], None] | None = None,
    ) -> None:
        """Start every instance at once and wait until each answers ``/health``, calling
        ``on_started`` for each child started and ``while_waiting`` every few seconds.

        Raises :class:`ChildFailed` (quoting the failing child's log) when one exits or does
        not become ready within ``timeout``; the caller then calls :meth:`stop`.
        """
        self._launch_argv, self._env = list(launch_argv), dict(env)
        for spec in specs:
            process = ManagedProcess(
                spec.name,
                instance_argv(spec, launch_argv),
                self.log_dir / f"{spec.name}.log",
                env=instance_env(spec, env),
            )
            child = Child(spec.name, process, spec)
            self.instances.append(child)
            if on_started is not None:
                on_started(child)
            logger.info(
                "started %s (pid %d) on port %d%s, log %s",
                spec.name, process.pid, spec.port,
                f", cores {','.join(map(str, spec.cores))}" if spec.cores else "",
                process.log_path,
            )  # fmt: skip
        start = time.monotonic()
        pool = ThreadPoolExecutor(len(self.instances) or 1)
        try:
            waits = [
                pool.submit(self._wait_ready, instance, timeout) for instance in self.instances
            ]
            pending = set(waits)
            while pending:
                done, pending = wait(pending, WAITING_CALL_EVERY_S, FIRST_EXCEPTION)
                for future in done:
                    future.result()  # raises the first failure
                if while_waiting is not None:
                    while_waiting()
        finally:
            # Not waiting for the others on a failure or a signal: stop() ends their waits,
            # since a stopped child fails its readiness poll at once.
            pool.shutdown(wait=False, cancel_futures=True)
        logger.info(
            "%d instances ready after %.0f s", len(self.instances), time.monotonic() - start
        )

    def respawn(self, child: Child) -> ManagedProcess:
        """A new run of ``child``, which must have exited; the caller owns it. An instance
        running as two pipeline stages (its spec has ``unsplit``) comes back whole, on its own
        cores: ``child.spec`` becomes that spec, so a stage on a borrowed core that failed
        once does not take the instance down again."""
        spec = child.spec
        if spec is None or spec.unsplit is None:
            return child.process.respawn()
        whole = spec.unsplit
        again = child.process.respawn(instance_argv(whole, self._launch_argv),
                                      instance_env(whole, self._env))  # fmt: skip
        child.spec = whole
        logger.warning("%s restarts whole, as one stage on its own cores (%s): its later "
                       "layers no longer run on a borrowed core", child.name,
                       ",".join(map(str, whole.cores)) or "unpinned")  # fmt: skip
        return again

    def _wait_ready(self, instance: Child, timeout: float) -> None:
        took = instance.process.wait_http_ok(
            f"{instance.url}/health", timeout, progress_every=PROGRESS_EVERY_S
        )
        logger.info("%s ready after %.0f s", instance.name, took)

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        # In parallel: each SGLang server takes seconds to wind down.
        if self.instances:
            with ThreadPoolExecutor(len(self.instances)) as pool:
                list(pool.map(lambda instance: instance.process.stop(), self.instances))
        if self.store is not None:
            self.store.process.stop()
        logger.info("cluster stopped: %d instances", len(self.instances))


def default_log_dir() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"banaserve-cluster-{os.getpid()}-"))


__all__ = ["Child", "ChildFailed", "ClusterProcesses", "default_log_dir"]
