"""Child processes started, watched and stopped by PID.

Every child runs in its own session (process group), so stopping it also stops whatever it
spawned (an SGLang server spawns a scheduler and a detokenizer). Output goes to a log file
whose last lines are quoted when the child fails, so a crash is never silent. A child dies
with its parent: the kernel sends it SIGKILL when the thread that started it ends
(``PR_SET_PDEATHSIG``), so a launcher killed by the OOM killer leaves nothing running.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

#: Where :func:`free_port` looks first: below Linux's default ephemeral range (32768-60999).
LISTEN_PORTS = range(20000, 32768)


def _ephemeral_range() -> range:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port to listen on that was free a moment ago.

    Picked outside the kernel's ephemeral range: a server that starts slowly (SGLang takes
    half a minute) would otherwise lose its port to the local end of some outgoing connection
    made meanwhile (hundreds are, by store clients and health polls), and fail to bind.
    Falls back to any free port if none is found there.
    """
    ephemeral = _ephemeral_range()
    candidates = [p for p in random.sample(LISTEN_PORTS, 64) if p not in ephemeral]
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: signal.Signals = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent thread ends.

    libc is resolved here, in the parent: between fork and exec the child only makes the
    system call. A parent that died before the call leaves the child orphaned already
    (``getppid`` changed), so the child exits at once.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:
            os._exit(1)

    return arm


class ChildFailed(RuntimeError):
    """A child exited, or did not become ready in time; the message quotes its log."""


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file, or a note that there is none."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def open_private_log(path: Path) -> BinaryIO:
    """``path`` opened for appending, created readable by this user only: a server's log
    holds its arguments (SGLang prints every one, the admin token among them)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")


class ManagedProcess:
    """One child process with its own log file.

    The owner must call :meth:`stop` (or use it as a context manager); stopping is
    idempotent. Not thread-safe: one owner drives it. With ``die_with_parent`` (the
    default) the child is killed when the *thread* that created this object ends, so
    create it from the main thread or another thread that outlives the child.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.die_with_parent = die_with_parent
        log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._log = open_private_log(log_path)
        self.log_offset = self._log.tell()  # where this run's output starts
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=parent_death_signal() if die_with_parent else None,
        )

    def respawn(
        self, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        """A new run of the same command (or of ``argv`` with ``env``), logging to the same
        file (appended). This process must have exited; the caller owns the new one."""
        if self.alive():
            raise RuntimeError(f"{self.name} (pid {self.pid}) is still running")
        self.stop()  # closes the log; kills whatever the old run left in its group
        return ManagedProcess(
            self.name, self.argv if argv is None else argv, self.log_path,
            self.env if env is None else env, self.cwd, self.die_with_parent,
        )  # fmt: skip

    def log_since_start(self, max_bytes: int = 1 << 20) -> str:
        """The end of what this run logged (at most ``max_bytes``)."""
        try:
            with open(self.log_path, "rb") as log:
                size = log.seek(0, os.SEEK_END)
                log.seek(max(self.log_offset, size - max_bytes))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def failure(self, why: str) -> ChildFailed:
        return ChildFailed(
            f"{self.name} (pid {self.pid}) {why}; last lines of "
            f"{self.log_path}:\n{tail(self.log_path)}"
        )

    def wait_http_ok(self, url: str, timeout: float, progress_every: float = 0.0) -> float:
        """Poll ``url`` until it answers 200; return the seconds it took.

        Raises :class:`ChildFailed` if the child exits first or ``timeout`` passes. With
        ``progress_every`` > 0, prints a line to stderr that often, so a long start-up is
        visibly alive.
        """
        start = time.monotonic()
        next_note = start + progress_every
        while True:
            if not self.alive():
                raise self.failure(f"exited with code {self.process.returncode} before ready")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            now = time.monotonic()
            if now - start > timeout:
                raise self.failure(f"not ready at {url} after {timeout:.0f} s")
            if progress_every and now >= next_note:
                print(
                    f"[banaserve] waiting for {self.name}: {now - start:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                next_note = now + progress_every
            time.sleep(0.5)

    def wait_tcp_open(self, host: str, port: int, timeout: float) -> float:
        """Wait until ``host:port`` accepts a connection; raise :class:`ChildFailed` if the
        child exits first or ``timeout`` passes. Returns the seconds it took."""
        start = time.monotonic()
        while True:
            if not self.alive():
                raise self.failure(f"exited with code {self.process.returncode} before ready")
            try:
                with socket.create_connection((host, port), timeout=1):
                    return time.monotonic() - start
            except OSError:
                pass
            if time.monotonic() - start > timeout:
                raise self.failure(f"not listening on {host}:{port} after {timeout:.0f} s")
            time.sleep(0.2)

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds."""
        if self.alive():
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait(timeout=grace)
        # Children of the child may outlive it in the same group: make sure they go too.
        self._signal_group(signal.SIGKILL)
        if not self._log.closed:
            self._log.close()
        return self.process.returncode

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit in the main thread, as Ctrl-C raises KeyboardInterrupt.

    Python's default SIGTERM action ends the process without unwinding, so ``finally``
    blocks that stop children (each in a session of its own, out of reach of a signal to
    this process's group) would never run. Call from the main thread of a process that owns
    children.
    """

    def raise_exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, raise_exit)
