"""The cluster's child processes: the embedded store shard and the SGLang instances.

Every child is a :class:`~banaserve.utils.processes.ManagedProcess` in its own process group
with its own log file, so stopping one stops whatever it spawned, and a crash is reported
with the last lines it logged.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from banaserve.cluster.topology import InstanceSpec
from banaserve.utils.processes import ChildFailed, ManagedProcess, tail

logger = logging.getLogger("banaserve.cluster")

#: SGLang takes 25-40 s to start on these machines, several at once on 2 cores much longer.
START_TIMEOUT_S = 600.0
PROGRESS_EVERY_S = 15.0


@dataclass
class Instance:
    """A started SGLang instance; ``process`` is owned by :class:`ClusterProcesses`."""

    spec: InstanceSpec
    process: ManagedProcess
    crash_reported: bool = field(default=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url


def instance_argv(spec: InstanceSpec, launch_argv: Sequence[str]) -> list[str]:
    """``launch_server`` for one instance, pinned with ``taskset`` when it has cores."""
    argv = [
        sys.executable, "-m", "banaserve.launch_server", *launch_argv,
        "--host", "127.0.0.1", "--port", str(spec.port),
    ]  # fmt: skip
    if spec.cores:
        argv = ["taskset", "-c", ",".join(map(str, spec.cores)), *argv]
    return argv


def instance_env(spec: InstanceSpec, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    if spec.cores and "OMP_NUM_THREADS" not in base:
        # torch starts one thread per visible core otherwise, and pinned cores are few.
        env["OMP_NUM_THREADS"] = str(len(spec.cores))
    return env


class ClusterProcesses:
    """Starts, watches and stops the instances (and the store process, when given).

    Thread-safe for :meth:`dead_instances` and :meth:`stop` from any thread; start-up runs in
    the caller's thread. Stop is idempotent: instances first (in parallel), then the store.
    """

    def __init__(self, log_dir: Path, store: ManagedProcess | None = None) -> None:
        self.log_dir = log_dir
        self.store = store
        self.instances: list[Instance] = []
        self._lock = threading.Lock()
        self._stopped = False

    def start(
        self,
        specs: Sequence[InstanceSpec],
        launch_argv: Sequence[str],
        env: dict[str, str],
        timeout: float = START_TIMEOUT_S,
    ) -> None:
        """Start every instance at once and wait until each answers ``/health``.

        Raises :class:`ChildFailed` (quoting the failing child's log) when one exits or does
        not become ready within ``timeout``; the caller then calls :meth:`stop`.
        """
        for spec in specs:
            process = ManagedProcess(
                spec.name,
                instance_argv(spec, launch_argv),
                self.log_dir / f"{spec.name}.log",
                env=instance_env(spec, env),
            )
            self.instances.append(Instance(spec, process))
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
            for future in waits:
                future.result()
        finally:
            # Not waiting for the others on a failure or a signal: stop() ends their waits,
            # since a stopped child fails its readiness poll at once.
            pool.shutdown(wait=False, cancel_futures=True)
        logger.info(
            "%d instances ready after %.0f s", len(self.instances), time.monotonic() - start
        )

    def _wait_ready(self, instance: Instance, timeout: float) -> None:
        took = instance.process.wait_http_ok(
            f"{instance.url}/health", timeout, progress_every=PROGRESS_EVERY_S
        )
        logger.info("%s ready after %.0f s", instance.name, took)

    def dead_instances(self, on_crash: Callable[[Instance, str], None] | None = None) -> set[str]:
        """Names of instances whose process has exited. A crash is reported once, with the
        last lines of its log, to ``on_crash`` (default: the log)."""
        dead = set()
        for instance in self.instances:
            if instance.process.alive():
                continue
            dead.add(instance.name)
            with self._lock:
                if instance.crash_reported or self._stopped:
                    continue
                instance.crash_reported = True
            message = (
                f"{instance.name} (pid {instance.process.pid}) exited with code "
                f"{instance.process.process.returncode}; last lines of "
                f"{instance.process.log_path}:\n{tail(instance.process.log_path, 20)}"
            )
            (on_crash or (lambda _, text: logger.error(text)))(instance, message)
        return dead

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
            self.store.stop()
        logger.info("cluster stopped: %d instances", len(self.instances))


def default_log_dir() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"banaserve-cluster-{os.getpid()}-"))


__all__ = ["ChildFailed", "ClusterProcesses", "Instance", "default_log_dir"]
