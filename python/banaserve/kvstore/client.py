"""The KV store client: pages by key over a sharded, replicated set of store servers.

Failure model: a shard that cannot be reached (refused, reset, timed out, broken replies) is
marked down and retried after :attr:`KvStoreClient.RETRY_AFTER_S` (doubling while it stays
down, up to :attr:`KvStoreClient.MAX_RETRY_AFTER_S`); meanwhile reads go to the
other replicas and a page no replica can serve is a miss (the caller recomputes it). A down
shard never raises. What does raise: :class:`KvStoreAuthError` (wrong or missing token), a
server that refuses the protocol (version mismatch, shm across hosts), and caller errors
(``ValueError``/``TypeError``: a key that is not 32 bytes, a buffer of the wrong size).

In-flight prefix coalescing: :meth:`KvStoreClient.lookup` asks each key's primary live replica
for it, waiting (bounded) for keys another owner is computing and claiming the missing tail
for the caller; see :mod:`banaserve.kvstore.claims`.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

from banaserve.kvstore.keys import KEY_BYTES, KvLayout
from banaserve.kvstore.protocol import (
    MAX_KEYS_PER_FRAME,
    MAX_LEASE_MS,
    MAX_OWNER_CHARS,
    MAX_WAIT_MS,
    MISSING,
    ErrorCode,
    Limits,
    Op,
    ProtocolError,
)
from banaserve.kvstore.sharding import HashRing
from banaserve.kvstore.transport import (
    Address,
    KvStoreAuthError,
    KvStoreError,
    KvStoreRemoteError,
    Transport,
    open_transport,
    parse_url,
)

logger = logging.getLogger("banaserve.kvstore.client")

__all__ = ["KvStoreAuthError", "KvStoreClient", "KvStoreError", "KvStoreRemoteError"]

T = TypeVar("T")


class _Unavailable(Exception):
    """A shard could not serve a request; it has been marked down. Never leaves this module."""


class _Shard:
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

        Raises _Unavailable (the shard is now marked down), KvStoreAuthError, or
        KvStoreError/KvStoreRemoteError for a refusal the caller must see. Blocks for one
        round trip, each socket operation bounded by the timeout (``timeout`` for this call
        only, if given: a LOOKUP that the server may hold for its wait).
        """
        if not self.available():
            raise _Unavailable(self.last_error)
        transport = self._acquire()
        try:
            if timeout is not None:
                _set_timeout(transport, timeout)
            reply = transport.request(op, control, payload, sink, reply_capacity)
            if check is not None:
                check(reply)
        except KvStoreRemoteError as exc:
            if exc.code != ErrorCode.INTERNAL.value:
                raise
            self._mark_down(exc)
            raise _Unavailable(str(exc)) from exc
        except (OSError, ProtocolError) as exc:
            self._mark_down(exc)
            raise _Unavailable(str(exc)) from exc
        else:
            self._mark_up()  # before the release, which pools connections of live shards only
            return reply
        finally:
            if timeout is not None and transport.connected:
                _set_timeout(transport, self._timeout)
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
            raise _Unavailable(str(exc)) from exc
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


class KvStoreClient:
    """Pages by 32-byte key on one or more store servers.

    ``urls``: shard URLs (a list, or one string with commas), ``tcp://host:port`` or
    ``shm://host:port`` (same host only). Each page lives on ``replication`` shards chosen by
    consistent hashing. ``timeout`` bounds every socket operation, in seconds.

    Thread-safe: any number of threads may call any method at once. Each shard keeps a small
    pool of connections (:attr:`CONNECTIONS_PER_SHARD`); a call fans out to its shards in
    parallel with one round trip per shard (more only if a batch exceeds a frame's limits, or
    a miss or failure sends keys on to their next replica). Every method blocks until done.

    Buffers are the caller's: the client reads (``put``) or writes (``get``) them during the
    call only and keeps no reference. Any C-contiguous object with the buffer protocol works
    (numpy arrays, bytearray, memoryview), and CPU torch tensors; a page may also be given as
    a list of such segments. Over ``tcp://`` bytes move straight between the socket and these
    buffers; over ``shm://`` they are copied once to or from the shared segment.

    The constructor connects to every shard, so a wrong token raises here.
    """

    #: Seconds a down shard is left alone before a call tries it again; doubles per failed
    #: retry up to MAX_RETRY_AFTER_S.
    RETRY_AFTER_S: ClassVar[float] = 2.0
    MAX_RETRY_AFTER_S: ClassVar[float] = 30.0
    CONNECTIONS_PER_SHARD: ClassVar[int] = 4
    #: Connections per shard for :meth:`lookup` only, apart from the others: a lookup may be
    #: held by the server while it waits, and must never keep the PUT it waits for (from
    #: this same client) from getting a connection or a thread.
    LOOKUP_CONNECTIONS_PER_SHARD: ClassVar[int] = 16

    def __init__(
        self,
        urls: str | Sequence[str],
        token: str | None = None,
        replication: int = 1,
        timeout: float = 10.0,
    ) -> None:
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        addresses = [parse_url(url) for url in urls]
        if not addresses:
            raise ValueError("KvStoreClient needs at least one shard URL")
        if not 1 <= replication <= len(addresses):
            raise ValueError(
                f"replication {replication} needs at least that many shards, got {len(addresses)}"
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.replication = replication
        self._shards = [
            _Shard(
                a,
                token,
                timeout,
                self.CONNECTIONS_PER_SHARD,
                self.RETRY_AFTER_S,
                self.MAX_RETRY_AFTER_S,
            )
            for a in addresses
        ]
        # Same servers, own pools (see LOOKUP_CONNECTIONS_PER_SHARD); connected on first use.
        self._lookup_shards = [
            _Shard(
                a,
                token,
                timeout,
                self.LOOKUP_CONNECTIONS_PER_SHARD,
                self.RETRY_AFTER_S,
                self.MAX_RETRY_AFTER_S,
            )
            for a in addresses
        ]
        endpoints = [a.endpoint for a in addresses]
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"shard URLs {list(urls)} name the same server more than once")
        self._ring = HashRing(endpoints)
        # Enough workers for every pooled connection, so parallel callers do not queue here.
        self._pool = (
            ThreadPoolExecutor(
                len(self._shards) * self.CONNECTIONS_PER_SHARD,
                thread_name_prefix="kvstore-client",
            )
            if len(self._shards) > 1
            else None
        )
        self._lookup_pool = (
            ThreadPoolExecutor(
                len(self._shards) * self.LOOKUP_CONNECTIONS_PER_SHARD,
                thread_name_prefix="kvstore-lookup",
            )
            if len(self._shards) > 1
            else None
        )
        try:
            self._fan_out({i: None for i in range(len(self._shards))}, self._probe)
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> list[str]:
        return [shard.url for shard in self._shards]

    # -- reads ------------------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored on any of its live replicas (no hit counted)."""
        keys = _check_keys(keys)

        def fetch(shard: _Shard, idx: list[int]) -> list[bool]:
            out: list[bool] = []
            for chunk in _chunks(idx, [0] * len(keys), shard.max_payload):
                reply = shard.call(
                    Op.EXISTS,
                    {"keys": [keys[i] for i in chunk]},
                    check=_length_check("present", len(chunk), Op.EXISTS),
                )
                out += reply["present"]
            return out

        return self._read(keys, fetch)

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys (a chained prefix) are stored."""
        present = self.exists(keys)
        return next((i for i, hit in enumerate(present) if not hit), len(present))

    def lookup(
        self,
        keys: Sequence[bytes],
        *,
        owner: str,
        wait_s: float = 0.0,
        lease_s: float = 30.0,
        claim: bool = True,
    ) -> int:
        """How many leading keys (a chained prefix) are stored, after waiting up to ``wait_s``
        for keys another owner is computing; with ``claim``, the missing tail is claimed for
        ``owner`` for ``lease_s`` seconds, so other lookups wait for this caller's PUT.

        ``owner`` names the computation that will PUT the missing pages (1 to 256 chars): an
        instance id, or a request id to coalesce requests within one instance too (a lookup
        never waits for its own owner's claims; it renews them). The caller that got claims
        should PUT those pages (which ends the claims and wakes the waiters) or
        :meth:`release` them if it gives up; otherwise they end with the lease, or when this
        client closes (the claims are tied to its connections).

        Each key is asked of its first live replica only (claims on one server per key are
        enough, as every client sends the key's LOOKUP there; a replica that fails during the
        call passes its keys on to the next one); shards are asked in parallel,
        each with its keys in their original order and the whole ``wait_s`` budget. So a shard
        may wait for key j while a key i < j on another shard is missing (time spent for
        nothing, never a wrong answer), and each shard claims its own missing tail: together,
        every missing key from the first missing one on (all of which the caller computes).
        Keys of a down shard are missing and unclaimed; a key stored only on a non-primary
        replica counts as missing. Never raises for a down shard. Blocks up to about
        ``wait_s`` (plus the timeout, for a server that hangs); ``wait_s`` = 0: one round trip.
        """
        keys = _check_keys(keys)
        if not isinstance(owner, str) or not 0 < len(owner) <= MAX_OWNER_CHARS:
            raise ValueError(f"owner must be a str of 1 to {MAX_OWNER_CHARS} characters")
        if not 0 <= wait_s <= MAX_WAIT_MS / 1000:
            raise ValueError(f"wait_s must be in [0, {MAX_WAIT_MS / 1000:g}], got {wait_s}")
        if not 0 < lease_s <= MAX_LEASE_MS / 1000:
            raise ValueError(f"lease_s must be in (0, {MAX_LEASE_MS / 1000:g}], got {lease_s}")
        lease_ms = min(MAX_LEASE_MS, max(1, round(lease_s * 1000)))
        deadline = time.monotonic() + wait_s

        def ask(shard: _Shard, idx: list[int]) -> list[bool]:
            out: list[bool] = []
            missed = False
            for chunk in _chunks(idx, [0] * len(keys), shard.max_payload):
                # One deadline for the whole call; no waiting past a miss (useless past it).
                left = 0.0 if missed else max(0.0, deadline - time.monotonic())
                control = {
                    "keys": [keys[i] for i in chunk],
                    "owner": owner,
                    "wait_ms": min(MAX_WAIT_MS, math.ceil(left * 1000)),
                    "lease_ms": lease_ms,
                    "claim": claim,
                }
                reply = shard.call(
                    Op.LOOKUP,
                    control,
                    check=_lookup_check(len(chunk)),
                    timeout=shard.timeout + left,
                )
                out += reply["present"]
                missed = missed or not all(reply["present"])
            return out

        def live(s: int) -> bool:
            return self._shards[s].available() and self._lookup_shards[s].available()

        present = [False] * len(keys)
        replicas = [self._ring.replica_indices(key, self.replication) for key in keys]
        tried = [0] * len(keys)
        pending = list(range(len(keys)))
        # Round k sends each key to its k-th live replica; only keys whose shard failed in
        # this call go round again (a shard that just died must not turn a hit on its
        # replica into a miss).
        while pending:
            groups: dict[int, list[int]] = defaultdict(list)
            for i in sorted(pending):
                order = replicas[i]
                while tried[i] < len(order) and not live(order[tried[i]]):
                    tried[i] += 1
                if tried[i] < len(order):
                    groups[order[tried[i]]].append(i)
                    tried[i] += 1
            pending = []
            for s, result in self._fan_out(
                groups, ask, self._lookup_shards, self._lookup_pool
            ).items():
                if result is None:
                    pending += [i for i in groups[s] if tried[i] < len(replicas[i])]
                    continue
                for i, hit in zip(groups[s], result, strict=False):
                    present[i] = hit
        return next((i for i, hit in enumerate(present) if not hit), len(present))

    def release(self, keys: Sequence[bytes], owner: str) -> list[bool]:
        """End ``owner``'s claims on ``keys`` (a computation given up), so that waiters stop
        waiting and compute them. True where a claim was ended; a down shard's keys: False."""
        keys = _check_keys(keys)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            for s in self._ring.replica_indices(key, self.replication):
                if self._lookup_shards[s].available():
                    groups[s].append(i)
                    break

        def ask(shard: _Shard, idx: list[int]) -> list[bool]:
            out: list[bool] = []
            for chunk in _chunks(idx, [0] * len(keys), shard.max_payload):
                reply = shard.call(
                    Op.RELEASE,
                    {"keys": [keys[i] for i in chunk], "owner": owner},
                    check=_length_check("released", len(chunk), Op.RELEASE),
                )
                out += reply["released"]
            return out

        released = [False] * len(keys)
        results = self._fan_out(groups, ask, self._lookup_shards, self._lookup_pool)
        for s, result in results.items():
            for i, ok in zip(groups[s], result or (), strict=False):
                released[i] = ok
        return released

    def get(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Any],
        byte_range: tuple[int, int] | None = None,
    ) -> list[bool]:
        """Read pages straight into ``buffers``; True where a page was found.

        Each buffer is exactly one page, or exactly ``byte_range[1]`` bytes with ``byte_range``
        = (offset, length), which is applied to every page. A buffer may also be a list or
        tuple of segments, filled in order (scatter). A page of another size counts as a
        miss. A miss leaves its buffer untouched, except that over ``tcp://`` a shard failing
        in the middle of a reply may leave part of a page in a buffer reported False.
        """
        keys = _check_keys(keys)
        pages = _pages(buffers, len(keys), writable=True)
        if byte_range is not None:
            offset, length = _check_range(byte_range)
        lengths = [sum(v.nbytes for v in page) for page in pages]
        if byte_range is not None:
            for i, size in enumerate(lengths):
                if size != length:
                    raise ValueError(f"buffer {i} has {size} bytes, byte_range {length}")

        def fetch(shard: _Shard, idx: list[int]) -> list[bool]:
            out: list[bool] = []
            for chunk in _chunks(idx, lengths, shard.max_payload):
                control = {
                    "keys": [keys[i] for i in chunk],
                    "lengths": [lengths[i] for i in chunk],
                    "range": list(byte_range) if byte_range is not None else None,
                }

                def sink(reply: dict[str, Any], chunk: list[int] = chunk) -> list[memoryview]:
                    _length_check("sizes", len(chunk), Op.GET)(reply)
                    sizes = reply["sizes"]
                    targets = []
                    for i, size in zip(chunk, sizes, strict=True):
                        if size == MISSING:
                            continue
                        if size != lengths[i]:
                            raise ProtocolError(f"GET sent {size} bytes for a {lengths[i]} page")
                        targets += pages[i]
                    return targets

                reply = shard.call(
                    Op.GET,
                    control,
                    sink=sink,
                    reply_capacity=sum(lengths[i] for i in chunk),
                    check=sink,  # the sizes are vetted also when no payload came
                )
                out += [size != MISSING for size in reply["sizes"]]
            return out

        return self._read(keys, fetch)

    def get_layers(
        self,
        keys: Sequence[bytes],
        layout: KvLayout,
        start: int,
        stop: int,
        buffers: Sequence[Any],
    ) -> list[bool]:
        """Read layers [start, stop) of each page (one contiguous range in ``layout``)."""
        return self.get(keys, buffers, byte_range=layout.layer_range(start, stop))

    # -- writes -----------------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        """Store each buffer's bytes under its key on every live replica; True where at least
        one replica stored it (False: no replica reachable, or the page does not fit).

        A buffer may be a list or tuple of segments: the page is their concatenation (gather).
        """
        keys = _check_keys(keys)
        pages = _pages(buffers, len(keys), writable=False)
        sizes = [sum(v.nbytes for v in page) for page in pages]
        groups: dict[int, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            for s in self._ring.replica_indices(key, self.replication):
                if self._shards[s].available():
                    groups[s].append(i)

        def store(shard: _Shard, idx: list[int]) -> list[bool]:
            out: list[bool] = []
            for chunk in _chunks(idx, sizes, shard.max_payload):
                control = {"keys": [keys[i] for i in chunk], "sizes": [sizes[i] for i in chunk]}
                reply = shard.call(
                    Op.PUT,
                    control,
                    [view for i in chunk for view in pages[i]],
                    check=_length_check("stored", len(chunk), Op.PUT),
                )
                out += reply["stored"]
            return out

        stored = [False] * len(keys)
        for s, result in self._fan_out(groups, store).items():
            for i, ok in zip(groups[s], result or (), strict=False):
                stored[i] = stored[i] or ok
        return stored

    # -- operations -------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per shard URL: ``{"up": True, <StoreStats fields>..., "server": {...}}`` as the
        server reports them, or ``{"up": False, "error": reason}`` for a shard that is down."""

        def one(shard: _Shard, _: None) -> dict[str, Any]:
            reply = shard.call(Op.STATS, {})
            return {"up": True, **reply["store"], "server": reply["server"]}

        results = self._fan_out({i: None for i in range(len(self._shards))}, one)
        return {
            shard.url: results[i] or {"up": False, "error": shard.last_error or "unreachable"}
            for i, shard in enumerate(self._shards)
        }

    def close(self) -> None:
        """Close every idle connection (busy ones close when returned); idempotent."""
        for shard in (*self._shards, *self._lookup_shards):
            shard.close()
        for pool in (self._pool, self._lookup_pool):
            if pool is not None:
                pool.shutdown(wait=False)

    def __enter__(self) -> KvStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _probe(self, shard: _Shard, _: None) -> None:
        shard.call(Op.STATS, {})

    def _read(
        self, keys: list[bytes], fetch: Callable[[_Shard, list[int]], list[bool]]
    ) -> list[bool]:
        """Ask each key's replicas in order, skipping down shards, until a hit or none left.

        Round k sends every unresolved key to its next live replica, one batch per shard.
        """
        found = [False] * len(keys)
        replicas = [self._ring.replica_indices(key, self.replication) for key in keys]
        tried = [0] * len(keys)
        pending = list(range(len(keys)))
        while pending:
            groups: dict[int, list[int]] = defaultdict(list)
            for i in pending:
                order = replicas[i]
                while tried[i] < len(order) and not self._shards[order[tried[i]]].available():
                    tried[i] += 1
                if tried[i] < len(order):
                    groups[order[tried[i]]].append(i)
                    tried[i] += 1
            if not groups:
                break
            pending = []
            for s, result in self._fan_out(groups, fetch).items():
                for j, i in enumerate(groups[s]):
                    if result is not None and result[j]:
                        found[i] = True
                    elif tried[i] < len(replicas[i]):
                        pending.append(i)
        return found

    def _fan_out(
        self,
        groups: dict[int, Any],
        fn: Callable[[_Shard, Any], T],
        shards: list[_Shard] | None = None,
        pool: ThreadPoolExecutor | None = None,
    ) -> dict[int, T | None]:
        """``fn(shard, group)`` per shard, in parallel; None for a shard that was unavailable.

        ``shards`` and ``pool``: the lookup ones for lookups, else the regular ones. Other
        exceptions are raised once every shard has finished (no call is left running on a
        caller's buffers after this returns).
        """
        shards = self._shards if shards is None else shards
        pool = self._pool if pool is None else pool

        def guarded(s: int) -> T | None:
            try:
                return fn(shards[s], groups[s])
            except _Unavailable:
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


# -- argument checks --------------------------------------------------------------------------


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    out = []
    for i, key in enumerate(keys):
        if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
            what = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else repr(key)[:40]
            raise ValueError(f"key {i} must be {KEY_BYTES} bytes, got {what}")
        out.append(bytes(key))
    return out


def _check_range(byte_range: tuple[int, int]) -> tuple[int, int]:
    offset, length = byte_range
    if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length <= 0:
        raise ValueError(f"byte_range must be (offset >= 0, length > 0), got {byte_range!r}")
    return offset, length


def _pages(buffers: Sequence[Any], n: int, *, writable: bool) -> list[list[memoryview]]:
    """Each page's memory as byte views: one buffer, or a list/tuple of segments whose
    concatenation is the page (a page scattered over a layer-first host pool)."""
    if len(buffers) != n:
        raise ValueError(f"{len(buffers)} buffers for {n} keys")
    return [
        [byte_view(seg, writable=writable) for seg in buf]
        if isinstance(buf, (list, tuple))
        else [byte_view(buf, writable=writable)]
        for buf in buffers
    ]


def byte_view(buf: Any, *, writable: bool) -> memoryview:
    """A flat byte view of ``buf``'s memory (no copy). CPU torch tensors are viewed through
    numpy; anything else must support the buffer protocol and be C-contiguous."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"tensor buffers must be on the CPU, got {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("tensor buffers must be contiguous")
        # .numpy() refuses dtypes numpy lacks (bfloat16); a uint8 view of the memory does not.
        buf = buf.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"{type(buf).__name__} does not support the buffer protocol") from None
    if writable and view.readonly:
        raise ValueError(f"buffer of type {type(buf).__name__} is read-only")
    if not view.c_contiguous:
        raise ValueError(f"buffer of type {type(buf).__name__} is not C-contiguous")
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot view {type(buf).__name__} as bytes: {exc}") from None
    return view


def _chunks(idx: list[int], sizes: Sequence[int], max_bytes: int) -> Iterator[list[int]]:
    """Split ``idx`` into frames of at most MAX_KEYS_PER_FRAME keys and ``max_bytes`` bytes."""
    chunk: list[int] = []
    total = 0
    for i in idx:
        if sizes[i] > max_bytes:
            raise ValueError(f"page of {sizes[i]} bytes over the server's {max_bytes}-byte limit")
        if chunk and (len(chunk) == MAX_KEYS_PER_FRAME or total + sizes[i] > max_bytes):
            yield chunk
            chunk, total = [], 0
        chunk.append(i)
        total += sizes[i]
    if chunk:
        yield chunk


def _lookup_check(n: int) -> Callable[[dict[str, Any]], None]:
    """A LOOKUP reply check: one ``present`` and one ``claimed`` per key sent."""
    present = _length_check("present", n, Op.LOOKUP)
    claimed = _length_check("claimed", n, Op.LOOKUP)

    def check(reply: dict[str, Any]) -> None:
        present(reply)
        claimed(reply)

    return check


def _set_timeout(transport: Transport, seconds: float) -> None:
    """Set the per-operation timeout of a connected transport. Transports take it once, at
    construction, so this sets what each reads: ``timeout`` (ucx:// reads it per wait) and,
    over tcp:// and shm://, the socket's own timeout (set at connect)."""
    transport.timeout = seconds  # type: ignore[attr-defined]
    sock = getattr(transport, "_sock", None)
    if sock is not None:
        sock.settimeout(seconds)


def _length_check(field: str, n: int, op: Op) -> Callable[[dict[str, Any]], None]:
    """A reply check: ``field`` has one entry per key sent."""

    def check(reply: dict[str, Any]) -> None:
        if len(reply[field]) != n:
            raise ProtocolError(f"{op.name} reply has {len(reply[field])} {field} for {n} keys")

    return check
