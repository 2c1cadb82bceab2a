"""The unit suite's contract: no test here starts a process.

Everything that starts one (``subprocess``, ``asyncio`` subprocesses, ``multiprocessing``,
``os.fork``/``posix_spawn``/``system``) raises :class:`ProcessStartInUnitTest` naming the test,
and the test fails even if it caught that error: a unit test that needs a process belongs in
``test/e2e``. In-process servers, sockets, threads and event loops are fine.

The guard is on from each unit test's setup to its teardown, fixtures of any scope included
(a module-scoped fixture is set up inside its first test's setup). It is installed by hook
wrappers rather than an autouse fixture because a session- or module-scoped fixture is set
up before any function-scoped autouse fixture; and these hooks of this conftest run only for
the items under ``test/unit``, so an ``e2e`` test in the same run is unaffected.

Two helper processes are not the tests' doing: they start once per interpreter, in whichever
test first touches their library, so they are started here, before any test, see
:func:`_start_interpreter_helpers`.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import gc
import importlib
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def _start_interpreter_helpers() -> None:
    """Start now, outside every test, what the interpreter starts once on its own.

    - multiprocessing's resource tracker: the ``shm://`` transport's first ``SharedMemory``
      (in any in-process shm test) registers with it, which starts it;
    - flashinfer's ``ptxas --version`` probe, run by its import, which SGLang's model-layer
      modules (imported by the linker and attention tests) trigger.
    """
    multiprocessing.resource_tracker.ensure_running()
    with contextlib.suppress(ImportError):
        importlib.import_module("flashinfer.triton")


_start_interpreter_helpers()


class ProcessStartInUnitTest(RuntimeError):
    """A unit test tried to start a process."""


class _Guard:
    """Patches every way this interpreter starts a process to raise, while a unit test runs."""

    #: (owner, attribute) of each process-starting call; absent attributes are skipped.
    TARGETS: tuple[tuple[Any, str], ...] = (
        (subprocess.Popen, "_execute_child"),  # subprocess.*, asyncio subprocesses, os.popen
        (_posixsubprocess, "fork_exec"),  # the primitive below Popen and multiprocessing spawn
        (multiprocessing.process.BaseProcess, "start"),  # every multiprocessing context
        (os, "fork"),
        (os, "forkpty"),
        (os, "posix_spawn"),
        (os, "posix_spawnp"),
        (os, "system"),
        (os, "spawnv"),
        (os, "spawnve"),
        (os, "spawnvp"),
        (os, "spawnvpe"),
    )

    def __init__(self) -> None:
        self.test: str | None = None
        #: what the current test tried to start, for the check at its end
        self.violations: list[str] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _refuse(self, what: str) -> Callable[..., Any]:
        def refuse(*_args: Any, **_kwargs: Any) -> Any:
            message = (
                f"{self.test} started a process ({what}): unit tests must not start processes; "
                "move the test to test/e2e"
            )
            self.violations.append(message)
            raise ProcessStartInUnitTest(message)

        return refuse

    def install(self, test: str) -> None:
        self.test = test
        for owner, name in self.TARGETS:
            original = getattr(owner, name, None)
            if original is None:
                continue
            self._saved.append((owner, name, original))
            qualified = f"{getattr(owner, '__name__', owner)}.{name}"
            setattr(owner, name, self._refuse(qualified))

    def remove(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
        self.test = None


_guard = _Guard()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # the violations are per test: a clean slate before its fixtures run
    _guard.violations.clear()
    _guard.install(item.nodeid)
    try:
        return (yield)
    finally:
        _guard.remove()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _guard.install(item.nodeid)
    try:
        result = yield
    finally:
        _guard.remove()
    # also when the test swallowed the error (``except Exception``, a thread that died)
    if _guard.violations:
        pytest.fail("\n".join(_guard.violations), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    _guard.install(item.nodeid)
    try:
        return (yield)
    finally:
        _guard.remove()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (torch, SGLang, ...: some 450k objects) out of
    the cyclic GC's reach: it lives for the whole run, and every ``gc.collect()`` the tests
    call (test_pipeline's leak check, once per test) would walk it again, about 0.4 s of CPU
    each, a sixth of the suite's CPU time. Objects the tests create are collected as before."""
    gc.freeze()
