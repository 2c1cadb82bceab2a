"""Claim/wait test helpers: a fresh in-process server, background lookups, polling."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from banaserve.kvstore.client import KvStoreClient
from banaserve.kvstore.server import ServerConfig
from banaserve.kvstore.storage import TieredStore
from support.kvstore_server import TOKEN, InProcessServer


def in_process_server() -> Iterator[InProcessServer]:
    """A fresh store server in this process (its tests' ``server`` fixture: each test module
    declares it with ``pytest.fixture(in_process_server)``, which lint sees as no shadowing)."""
    store = TieredStore(64 << 20)
    srv = InProcessServer(store, ServerConfig(token=TOKEN))
    try:
        yield srv
    finally:
        srv.close()
        store.close()


def server_stats(url: str) -> dict[str, Any]:
    with KvStoreClient(url, token=TOKEN) as client:
        return client.stats()[url]["server"]


class Background:
    """Runs ``fn`` on a thread; ``result()`` joins it and returns (or raises) what it did, and
    ``elapsed`` is how long the call took."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._value: Any = None
        self._error: BaseException | None = None
        self.started = time.monotonic()
        self.finished: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:
            self._error = exc
        self.finished = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 30.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "background call did not finish"
        if self._error is not None:
            raise self._error
        return self._value

    @property
    def elapsed(self) -> float:
        assert self.finished is not None
        return self.finished - self.started


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def waiting(url: str, n: int = 1) -> Callable[[], bool]:
    """Whether the server has seen ``n`` LOOKUPs wait."""
    return lambda: server_stats(url)["claim_waits"] >= n
