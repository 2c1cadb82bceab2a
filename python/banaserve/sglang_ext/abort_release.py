"""Release the in-flight claims of a request that is aborted before it computes its pages.

With in-flight coalescing, a request's storage lookup claims the pages it misses
(:mod:`banaserve.sglang_ext.kvstore_backend`), and other requests that need those pages, on
any instance, wait up to ``--kv-store-coalesce-wait-s`` for them to reach the store. A request
aborted while it is still queued (its client went away, ``/abort_request``, a full queue)
never computes them: without a release, everyone waiting for its pages would sit out the whole
wait. SGLang drops an aborted request's cache-side state in
``Scheduler._release_aborted_request``; :func:`install` wraps that method so that every
:class:`ClaimLedger` of the process releases the request's claims right after.

A request that finishes normally releases nothing: its pages reach the store through SGLang's
write-back, which ends the claims and wakes the waiters with the pages.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

#: ``release(request_id, keys)``: end the claims that request holds on ``keys``.
Release = Callable[[str, list[bytes]], None]

_ledgers: weakref.WeakSet[ClaimLedger] = weakref.WeakSet()
_install_lock = threading.Lock()
_installed = False


class ClaimLedger:
    """The keys each request asked to claim, kept for as long as a claim can live (its lease).

    Thread-safe: :meth:`record` runs on SGLang's prefetch thread, :meth:`abort` on the
    scheduler's. ``release`` is called outside the lock and may block for a store round trip;
    an exception from it is logged, never raised into the scheduler. An abort that arrives
    while the request's lookup is still running is remembered for one lease, and the lookup's
    claims are released as soon as they are recorded. Memory is bounded by the requests of the
    last ``lease_s`` seconds.
    """

    def __init__(
        self, release: Release, lease_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self._release = release
        self._lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        # request id -> (expiry, keys); insertion order is expiry order (expiry = now + lease).
        self._claimed: OrderedDict[str, tuple[float, list[bytes]]] = OrderedDict()
        self._aborted: OrderedDict[str, tuple[float, list[bytes]]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._claimed)

    def record(self, request_id: str, keys: Sequence[bytes]) -> None:
        """``request_id``'s lookup asked to claim ``keys`` (a retry adds to earlier keys)."""
        if not keys:
            return
        with self._lock:
            now = self._clock()
            self._expire(now)
            if request_id in self._aborted:
                to_release = list(keys)
            else:
                _, earlier = self._claimed.pop(request_id, (now, []))
                self._claimed[request_id] = (now + self._lease_s, earlier + list(keys))
                return
        self._release_logged(request_id, to_release)

    def abort(self, request_id: str) -> None:
        """``request_id`` was aborted: release what it claimed, and what it claims later."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._aborted[request_id] = (now + self._lease_s, [])
            _, keys = self._claimed.pop(request_id, (now, []))
        if keys:
            self._release_logged(request_id, keys)

    def _expire(self, now: float) -> None:
        for table in (self._claimed, self._aborted):
            while table and next(iter(table.values()))[0] <= now:
                table.popitem(last=False)

    def _release_logged(self, request_id: str, keys: list[bytes]) -> None:
        try:
            self._release(request_id, keys)
        except Exception:  # the store being down must not fail the scheduler's abort
            logger.warning("could not release the claims of aborted request %s", request_id,
                           exc_info=True)  # fmt: skip


def register(ledger: ClaimLedger) -> None:
    """Have ``ledger`` told of every request this process's scheduler aborts."""
    install()
    _ledgers.add(ledger)


def request_aborted(request_id: str) -> None:
    """Tell every registered ledger that ``request_id`` was aborted."""
    for ledger in list(_ledgers):
        ledger.abort(request_id)


def install() -> None:
    """Wrap SGLang's ``Scheduler._release_aborted_request`` once per process (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from sglang.srt.managers.scheduler import Scheduler

        _installed = True
        original = getattr(Scheduler, "_release_aborted_request", None)
        if original is None:  # another SGLang version: coalescing still works, less promptly
            logger.warning(
                "this SGLang has no Scheduler._release_aborted_request: requests waiting for "
                "an aborted request's pages wait out --kv-store-coalesce-wait-s"
            )
            return
        Scheduler._release_aborted_request = _also_releasing_claims(original)


def _also_releasing_claims(original: Any) -> Any:
    @functools.wraps(original)
    def release_aborted_request(self: Any, req: Any) -> None:
        try:
            original(self, req)
        finally:
            request_aborted(str(req.rid))

    return release_aborted_request
