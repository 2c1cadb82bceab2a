"""One store server as the client sees it (a small pool of connections and its up/down state),
and calling several at once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from banaserve.kvstore.protocol import ErrorCode, Limits, Op, ProtocolError
from banaserve.kvstore.transport import (
    Address,
    KvStoreError,
    KvStoreRemoteError,
    Transport,
    open_transport,
)

logger = logging.getLogger("banaserve.kvstore.client")

T = TypeVar("T")


class ShardUnavailable(Exception):
    """A shard could not serve a request (it is marked down, or it was busy). Never leaves the
    client: a page it could not serve is a miss."""


class Shard:
    """One server: a small pool of connections and its up/down state.

    Thread-safe: the pool and the state live under ``_cond``; a connection is lent to one thread
    at a time and never used under the lock, so threads talk to one shard in parallel, up to
    ``max_connections``, and a thread beyond that blocks until a connection is returned.
    """

    def __init__(
        self,
        address: Address,
        token: str | None,
        timeout: float,
        max_connections: int,
        retry_after: float,
        max_retry_after: float,
    ) -> None:
        self.address = address
        self.url = address.url
        self.max_payload = Limits().max_payload
        self._token = token
        self._timeout = timeout
        self._max_connections = max_connections
        self._retry_after = retry_after
        self._max_retry_after = max(retry_after, max_retry_after)
        self._failures = 0
        self._cond = threading.Condition()
        self._idle: list[Transport] = []
        self._open = 0
        self._down = False
        self._down_until = 0.0
        self._closed = False
        self.last_error = ""

    @property
    def timeout(self) -> float:
        """Seconds each socket operation may take (a call may extend it for itself)."""
        return self._timeout

    def available(self) -> bool:
        """Up, or down long enough that the next call should try it again."""
        return not self._down or time.monotonic() >= self._down_until

    def call(
        self,
        op: Op,
        control: dict[str, Any],
        payload: Sequence[memoryview] = (),
        sink: Callable[[dict[str, Any]], Sequence[memoryview]] | None = None,
        reply_capacity: int = 0,
        check: Callable[[dict[str, Any]], object] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """One request on a pooled connection; ``check`` vets the reply (ProtocolError: bad).

        Raises ShardUnavailable (the shard is now marked down, or it answered BUSY: at its memory
        or connection bounds, this call only fails), KvStoreAuthError, or
        KvStoreError/KvStoreRemoteError for a refusal the caller must see. Blocks for one
        round trip, each socket operation bounded by the timeout (``timeout`` for this call
        only, if given: a LOOKUP that the server may hold for its wait).
        """
        if not self.available():
            raise ShardUnavailable(self.last_error)
        transport = self._acquire()
        try:
            if timeout is not None:
                set_timeout(transport, timeout)
            reply = transport.request(op, control, payload, sink, reply_capacity)
            if check is not None:
                check(reply)
        except KvStoreRemoteError as exc:
            if exc.code == ErrorCode.BUSY.value:  # at its bounds, not down: this call fails
                self.last_error = f"busy: {exc.remote_message}"
                raise ShardUnavailable(str(exc)) from exc
            if exc.code != ErrorCode.INTERNAL.value:
                raise
            self._mark_down(exc)
            raise ShardUnavailable(str(exc)) from exc
        except (OSError, ProtocolError) as exc:
            self._mark_down(exc)
            raise ShardUnavailable(str(exc)) from exc
        else:
            self._mark_up()  # before the release, which pools connections of live shards only
            return reply
        finally:
            if timeout is not None and transport.connected:
                set_timeout(transport, self._timeout)
            self._release(transport)

    def _acquire(self) -> Transport:
        with self._cond:
            while not self._closed and not self._idle and self._open >= self._max_connections:
                self._cond.wait()
            if self._closed:
                raise KvStoreError(f"kv store client for {self.url} is closed")
            if self._idle:
                return self._idle.pop()
            self._open += 1
        transport: Transport | None = None
        try:
            transport = open_transport(self.address, self._timeout)
            transport.connect(self._token)
        except (OSError, ProtocolError) as exc:
            self._forget(transport)
            self._mark_down(exc)
            raise ShardUnavailable(str(exc)) from exc
        except KvStoreRemoteError as exc:
            self._forget(transport)
            if exc.code != ErrorCode.BUSY.value:
                raise
            self.last_error = f"busy: {exc.remote_message}"  # at its connection cap
            raise ShardUnavailable(str(exc)) from exc
        except BaseException:
            self._forget(transport)
            raise
        self.max_payload = transport.max_payload
        return transport

    def _forget(self, transport: Transport | None) -> None:
        if transport is not None:
            transport.close()
        with self._cond:
            self._open -= 1
            self._cond.notify()

    def _release(self, transport: Transport) -> None:
        with self._cond:
            if transport.connected and not self._closed and not self._down:
                self._idle.append(transport)
                self._cond.notify()
                return
        transport.close()
        self._forget(None)

    def _mark_down(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        with self._cond:
            was_up = not self._down
            self._down = True
            # Back off further while it stays down: a hung host costs a timeout per retry.
            backoff = min(self._retry_after * 2**self._failures, self._max_retry_after)
            self._failures += 1
            self._down_until = time.monotonic() + backoff
            self.last_error = reason
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for transport in idle:  # they share the fate of the one that failed
            transport.close()
        if was_up:
            logger.warning(
                "kv store shard %s is down (%s): serving from its replicas, retrying in %g s",
                self.url,
                reason,
                backoff,
            )

    def _mark_up(self) -> None:
        if not self._down:
            return
        with self._cond:
            was_down, self._down = self._down, False
            self._failures = 0
        if was_down:
            logger.warning("kv store shard %s is back up", self.url)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for transport in idle:
            transport.close()


def set_timeout(transport: Transport, seconds: float) -> None:
    """Set the per-operation timeout of a connected transport. Transports take it once, at
    construction, so this sets what each reads: ``timeout`` (ucx:// reads it per wait) and,
    over tcp:// and shm://, the socket's own timeout (set at connect)."""
    transport.timeout = seconds  # type: ignore[attr-defined]
    sock = getattr(transport, "_sock", None)
    if sock is not None:
        sock.settimeout(seconds)


def fan_out(
    groups: dict[int, Any],
    fn: Callable[[Shard, Any], T],
    shards: list[Shard],
    pool: ThreadPoolExecutor | None,
) -> dict[int, T | None]:
    """``fn(shards[s], group)`` for each ``s, group`` of ``groups``, in parallel on ``pool``
    (the calling thread serves one itself); None for a shard that was unavailable. Other
    exceptions are raised once every shard has finished (no call is left running on a
    caller's buffers after this returns)."""

    def guarded(s: int) -> T | None:
        try:
            return fn(shards[s], groups[s])
        except ShardUnavailable:
            return None

    if pool is None or len(groups) <= 1:
        return {s: guarded(s) for s in groups}
    first, *rest = groups
    futures = {s: pool.submit(guarded, s) for s in rest}
    results: dict[int, T | None] = {}
    error: BaseException | None = None
    try:  # the calling thread serves one shard itself rather than wait idle
        results[first] = guarded(first)
    except BaseException as exc:
        error = exc
    for s, future in futures.items():
        try:
            results[s] = future.result()
        except BaseException as exc:  # re-raised below, after all have finished
            error = error or exc
    if error is not None:
        raise error
    return results
