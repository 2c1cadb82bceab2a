"""The KV store client itself: pages by key over a sharded, replicated set of store servers.

Failure model: a shard that cannot be reached (refused, reset, timed out, broken replies) is
marked down and retried after :attr:`KvStoreClient.RETRY_AFTER_S` (doubling while it stays
down, up to :attr:`KvStoreClient.MAX_RETRY_AFTER_S`); meanwhile reads go to the
other replicas and a page no replica can serve is a miss (the caller recomputes it). A down
shard never raises, nor does a busy one (a BUSY refusal: at its connection or memory bounds,
the call's pages on it are misses, or not stored; the shard stays up). What does raise:
:class:`KvStoreAuthError` (wrong or missing token), a server that refuses the protocol (version
mismatch, shm across hosts), and caller errors (``ValueError``/``TypeError``: a key that is not
32 bytes, a buffer of the wrong size).

In-flight prefix coalescing: :meth:`KvStoreClient.lookup` asks each key's primary live replica
for it, waiting (bounded) for keys another owner is computing and claiming the missing tail
for the caller; see :mod:`banaserve.kvstore.claims`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

from banaserve.kvstore.client.buffers import (
    check_keys,
    check_range,
    chunks,
    page_views,
)
from banaserve.kvstore.client.replicas import ReplicaRounds, live_replicas
from banaserve.kvstore.client.shard import Shard, fan_out
from banaserve.kvstore.keys import KvLayout
from banaserve.kvstore.op_specs import reply_check
from banaserve.kvstore.protocol import (
    MAX_LEASE_MS,
    MAX_OWNER_CHARS,
    MAX_WAIT_MS,
    MISSING,
    Op,
    ProtocolError,
)
from banaserve.kvstore.sharding import HashRing
from banaserve.kvstore.transport import (
    KvStoreError,
    parse_url,
)

logger = logging.getLogger("banaserve.kvstore.client")

__all__ = ["KvStoreClient"]

T = TypeVar("T")


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

        def shards(per_shard: int) -> list[Shard]:
            retry = (self.RETRY_AFTER_S, self.MAX_RETRY_AFTER_S)
            return [Shard(a, token, timeout, per_shard, *retry) for a in addresses]

        self._shards = shards(self.CONNECTIONS_PER_SHARD)
        # Same servers, own pools (see LOOKUP_CONNECTIONS_PER_SHARD); connected on first use.
        self._lookup_shards = shards(self.LOOKUP_CONNECTIONS_PER_SHARD)
        endpoints = [a.endpoint for a in addresses]
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"shard URLs {list(urls)} name the same server more than once")
        self._ring = HashRing(endpoints)

        def pool(per_shard: int, name: str) -> ThreadPoolExecutor | None:
            # Enough workers for every pooled connection, so parallel callers do not queue
            # here; none for one shard, which the calling thread serves itself.
            n = len(self._shards)
            return ThreadPoolExecutor(n * per_shard, thread_name_prefix=name) if n > 1 else None

        self._pool = pool(self.CONNECTIONS_PER_SHARD, "kvstore-client")
        self._lookup_pool = pool(self.LOOKUP_CONNECTIONS_PER_SHARD, "kvstore-lookup")
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
        keys = check_keys(keys)

        def fetch(shard: Shard, idx: list[int]) -> list[bool]:
            out: list[bool] = []
            for chunk in chunks(idx, [0] * len(keys), shard.max_payload):
                reply = shard.call(
                    Op.EXISTS,
                    {"keys": [keys[i] for i in chunk]},
                    check=reply_check(Op.EXISTS, len(chunk)),
                )
                out += reply["present"]
            return out

        return self._read(keys, fetch)

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys (a chained prefix) are stored."""
        return _leading(self.exists(keys))

    def lookup(
        self,
        keys: Sequence[bytes],
        *,
        owner: str,
        wait_s: float = 0.0,
        lease_s: float = 30.0,
        claim: bool = True,
        min_wait_keys: int = 0,
    ) -> int:
        """How many leading keys (a chained prefix) are stored, after waiting up to ``wait_s``
        for keys another owner is computing; with ``claim``, the missing tail is claimed for
        ``owner`` for ``lease_s`` seconds, so other lookups wait for this caller's PUT.

        ``min_wait_keys``: wait only if the keys stored or being computed by others reach at
        least this many from the first; a shorter hit is answered at once (a caller that
        would not load so short a prefix, as SGLang's HiCache below its prefetch threshold,
        would wait for nothing). Deciding it costs one more round trip, only when some key is
        claimed by another owner.

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
        keys = check_keys(keys)
        if not isinstance(owner, str) or not 0 < len(owner) <= MAX_OWNER_CHARS:
            raise ValueError(f"owner must be a str of 1 to {MAX_OWNER_CHARS} characters")
        if not 0 <= wait_s <= MAX_WAIT_MS / 1000:
            raise ValueError(f"wait_s must be in [0, {MAX_WAIT_MS / 1000:g}], got {wait_s}")
        if not 0 < lease_s <= MAX_LEASE_MS / 1000:
            raise ValueError(f"lease_s must be in (0, {MAX_LEASE_MS / 1000:g}], got {lease_s}")
        if not isinstance(min_wait_keys, int) or min_wait_keys < 0:
            raise ValueError(f"min_wait_keys must be a non-negative int, got {min_wait_keys!r}")
        lease_ms = min(MAX_LEASE_MS, max(1, round(lease_s * 1000)))
        if wait_s > 0 and min_wait_keys > 0:
            present, claimed = self._lookup(keys, owner, 0.0, lease_ms, claim)
            hit = _leading(present)
            # Where this caller starts computing: its first missing key not left to others.
            mine = (i for i, (p, c) in enumerate(zip(present, claimed, strict=True)) if not p and c)
            reach = next(mine, len(keys))
            if reach == hit or reach < min_wait_keys:
                return hit
        return _leading(self._lookup(keys, owner, wait_s, lease_ms, claim)[0])

    def _lookup(
        self, keys: list[bytes], owner: str, wait_s: float, lease_ms: int, claim: bool
    ) -> tuple[list[bool], list[bool]]:
        """One LOOKUP of ``keys`` on their shards: per key, stored and claimed for ``owner``."""
        deadline = time.monotonic() + wait_s

        def ask(shard: Shard, idx: list[int]) -> list[tuple[bool, bool]]:
            out: list[tuple[bool, bool]] = []
            missed = False
            for chunk in chunks(idx, [0] * len(keys), shard.max_payload):
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
                    check=reply_check(Op.LOOKUP, len(chunk)),
                    timeout=shard.timeout + left,
                )
                out += zip(reply["present"], reply["claimed"], strict=True)
                missed = missed or not all(reply["present"])
            return out

        def live(s: int) -> bool:
            return self._shards[s].available() and self._lookup_shards[s].available()

        present, claimed = [False] * len(keys), [False] * len(keys)
        rounds = ReplicaRounds(self._ring, keys, self.replication)
        pending = list(range(len(keys)))
        # Only keys whose shard failed in this call go round again (a shard that just died
        # must not turn a hit on its replica into a miss).
        while pending:
            groups = rounds.next_round(sorted(pending), live)
            pending = []
            for s, result in self._fan_out(
                groups, ask, self._lookup_shards, self._lookup_pool
            ).items():
                if result is None:
                    pending += [i for i in groups[s] if rounds.left(i)]
                    continue
                for i, (hit, mine) in zip(groups[s], result, strict=False):
                    present[i], claimed[i] = hit, mine
        return present, claimed

    def release(self, keys: Sequence[bytes], owner: str) -> list[bool]:
        """End ``owner``'s claims on ``keys`` (a computation given up), so that waiters stop
        waiting and compute them. True where a claim was ended; a down shard's keys: False."""
        keys = check_keys(keys)
        groups = live_replicas(
            self._ring,
            keys,
            self.replication,
            self._available(self._lookup_shards),
            first_only=True,
        )

        def ask(shard: Shard, idx: list[int]) -> list[bool]:
            out: list[bool] = []
            for chunk in chunks(idx, [0] * len(keys), shard.max_payload):
                reply = shard.call(
                    Op.RELEASE,
                    {"keys": [keys[i] for i in chunk], "owner": owner},
                    check=reply_check(Op.RELEASE, len(chunk)),
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
        keys = check_keys(keys)
        pages = page_views(buffers, len(keys), writable=True)
        if byte_range is not None:
            offset, length = check_range(byte_range)
        lengths = [sum(v.nbytes for v in page) for page in pages]
        if byte_range is not None:
            for i, size in enumerate(lengths):
                if size != length:
                    raise ValueError(f"buffer {i} has {size} bytes, byte_range {length}")

        def fetch(shard: Shard, idx: list[int]) -> list[bool]:
            out: list[bool] = []
            for chunk in chunks(idx, lengths, shard.max_payload):
                control = {
                    "keys": [keys[i] for i in chunk],
                    "lengths": [lengths[i] for i in chunk],
                    "range": list(byte_range) if byte_range is not None else None,
                }

                def sink(reply: dict[str, Any], chunk: list[int] = chunk) -> list[memoryview]:
                    reply_check(Op.GET, len(chunk))(reply)
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
        keys = check_keys(keys)
        pages = page_views(buffers, len(keys), writable=False)
        sizes = [sum(v.nbytes for v in page) for page in pages]
        groups = live_replicas(
            self._ring, keys, self.replication, self._available(self._shards), first_only=False
        )

        def store(shard: Shard, idx: list[int]) -> list[bool]:
            out: list[bool] = []
            for chunk in chunks(idx, sizes, shard.max_payload):
                control = {"keys": [keys[i] for i in chunk], "sizes": [sizes[i] for i in chunk]}
                reply = shard.call(
                    Op.PUT,
                    control,
                    [view for i in chunk for view in pages[i]],
                    check=reply_check(Op.PUT, len(chunk)),
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

        def one(shard: Shard, _: None) -> dict[str, Any]:
            reply = shard.call(Op.STATS, {})
            return {"up": True, **reply["store"], "server": reply["server"]}

        results = self._fan_out({i: None for i in range(len(self._shards))}, one)
        return {
            shard.url: results[i] or {"up": False, "error": shard.last_error or "unreachable"}
            for i, shard in enumerate(self._shards)
        }

    def clear(self) -> int:
        """Drop every page and every claim on every shard (CLEAR); the pages dropped, in total.

        Needs the shared token: a tenant token's CLEAR raises KvStoreAuthError. A shard that
        is down or busy raises KvStoreError naming it (after the others were cleared), since
        its pages are still there: a clear is all or an error, never silently partial.
        """

        def one(shard: Shard, _: None) -> int:
            return int(shard.call(Op.CLEAR, {})["dropped"])  # a count >= 0: OP_SPECS

        results = self._fan_out({i: None for i in range(len(self._shards))}, one)
        missed = [f"{self._shards[i].url} ({self._shards[i].last_error or 'unreachable'})"
                  for i, n in results.items() if n is None]  # fmt: skip
        if missed:
            raise KvStoreError(f"could not clear kv store shard(s) {', '.join(missed)}")
        return sum(n or 0 for n in results.values())

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

    def _probe(self, shard: Shard, _: None) -> None:
        shard.call(Op.STATS, {})

    def _read(
        self, keys: list[bytes], fetch: Callable[[Shard, list[int]], list[bool]]
    ) -> list[bool]:
        """Ask each key's replicas in order, skipping down shards, until a hit or none left.

        Round k sends every unresolved key to its next live replica, one batch per shard.
        """
        found = [False] * len(keys)
        rounds = ReplicaRounds(self._ring, keys, self.replication)
        live = self._available(self._shards)
        pending = list(range(len(keys)))
        while pending:
            groups = rounds.next_round(pending, live)
            if not groups:
                break
            pending = []
            for s, result in self._fan_out(groups, fetch).items():
                for j, i in enumerate(groups[s]):
                    if result is not None and result[j]:
                        found[i] = True
                    elif rounds.left(i):
                        pending.append(i)
        return found

    @staticmethod
    def _available(shards: list[Shard]) -> Callable[[int], bool]:
        return lambda s: shards[s].available()

    def _fan_out(
        self,
        groups: dict[int, Any],
        fn: Callable[[Shard, Any], T],
        shards: list[Shard] | None = None,
        pool: ThreadPoolExecutor | None = None,
    ) -> dict[int, T | None]:
        """:func:`fan_out` over the regular shards and pool unless given others (lookups)."""
        shards = self._shards if shards is None else shards
        return fan_out(groups, fn, shards, self._pool if pool is None else pool)


def _leading(present: Sequence[bool]) -> int:
    """How many leading entries of ``present`` are true: the stored prefix."""
    return next((i for i, hit in enumerate(present) if not hit), len(present))
