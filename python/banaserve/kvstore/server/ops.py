"""The store's operations, one handler per request op, whatever transport carried the request.

A handler takes a validated control map (keys already mapped into the connection's tenant
keyspace, see :mod:`banaserve.kvstore.auth`) and the request's payload bytes, wherever they
arrived (a socket buffer, a shared-memory segment), and returns what to answer: a control map
and, for GET, the pages to send after it. How a frame is read, how a reply travels and what a
transport does not offer are the transports' (:mod:`.tcp`, :mod:`.ucx`); what each op does to
the page store and the claim table is decided here only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from banaserve.kvstore.admission import (
    DEFAULT_ADMISSION_WAIT_S,
    DEFAULT_FRAME_TIMEOUT_S,
    DEFAULT_INFLIGHT_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    Admission,
    ByteBudget,
    ConnectionGate,
)
from banaserve.kvstore.auth import Authenticator, Grant, Handshake, check_clear
from banaserve.kvstore.claims import DEFAULT_MAX_CLAIMS, ClaimTable
from banaserve.kvstore.protocol import MISSING, PROTOCOL_VERSION, Limits, Op, ProtocolError
from banaserve.kvstore.server.lookup import Waiter, serve_lookup
from banaserve.kvstore.server.store_calls import contains_all, put_pages, read_pages, split_pages
from banaserve.kvstore.storage.base import PageStore

SERVER_NAME = "banaserve-kv-store"


@dataclass
class ServerConfig:
    """How a store process serves: addresses, tokens and every bound a peer is held to.

    A plain value, read by every listener of the process (tcp://, shm:// and ucx://) and
    never changed once serving starts; :meth:`admission` makes the bounds' live state.
    """

    host: str = "127.0.0.1"
    port: int = 0
    #: The shared token (the client-chosen keyspace). With neither it nor ``tenant_tokens``,
    #: any client may connect.
    token: str | None = None
    #: tenant -> token: each token grants that tenant's keyspace only (see ``auth``).
    tenant_tokens: dict[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    #: A new connection must send HELLO and AUTH within this many seconds (each, over tcp://).
    hello_timeout: float = 10.0
    store_threads: int = 4
    #: Call the store on the event loop itself. Right for a RAM-only store, whose calls never
    #: wait on disk (it saves a thread hop per request); with an SSD tier calls go to threads.
    store_inline: bool = False
    #: Keys the in-flight claim table holds at most (LOOKUP with ``claim``).
    max_claims: int = DEFAULT_MAX_CLAIMS
    #: Connections served at once (over it: BUSY and closed).
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: Bytes of request buffers (and GET replies being sent) across all connections.
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES
    #: How long a request waits for that budget before it is refused BUSY.
    admission_wait_s: float = DEFAULT_ADMISSION_WAIT_S
    #: Once its header arrived, a frame's body (or a GET reply's payload) must move within this.
    frame_timeout: float = DEFAULT_FRAME_TIMEOUT_S
    #: Reported by STATS so an operator sees what the store was started with.
    info: dict[str, Any] = field(default_factory=dict)

    def admission(self) -> Admission:
        """A fresh :class:`Admission` with these bounds."""
        return Admission(
            ConnectionGate(self.max_connections),
            ByteBudget(self.inflight_bytes),
            self.admission_wait_s,
            self.frame_timeout,
        )


class Session(Waiter, Protocol):
    """What a handler reads and sets of the connection that sent the request."""

    #: Whether AUTH succeeded (every op but HELLO and AUTH needs it).
    authenticated: bool
    #: What the AUTH's token granted.
    grant: Grant
    handshake: Handshake

    @property
    def shm_size(self) -> int | None:
        """Bytes of the shared-memory segment this connection announced; None without one."""
        ...

    def create_shm(self, size: int) -> tuple[str, int]:
        """Create a segment of ``size`` bytes for the client in place of any earlier one;
        its (name, size). A transport without shared memory raises ProtocolError, and so
        does a full /dev/shm."""
        ...


@dataclass
class Reply:
    """What a handler answers: the reply's control map, and for GET the found pages' bytes
    in key order (views of stored pages, which they pin until sent)."""

    control: dict[str, Any]
    pages: list[memoryview] = field(default_factory=list)


#: Runs a store call (``fn(*args)``) where the transport wants store calls to run (a thread
#: pool, or inline) and returns its result.
InStore = Callable[..., Awaitable[Any]]
Handler = Callable[[Session, dict[str, Any], memoryview], Awaitable[Reply]]

#: What each claim counter of STATS counts.
CLAIM_COUNTERS = (
    "claims",  # keys claimed (renewals included)
    "claim_waits",  # LOOKUPs that waited for a key claimed by another owner
    "coalesced",  # keys that became present during such a wait: computations saved
    "wait_timeouts",  # LOOKUPs whose wait ran out with the key still claimed
    "released",  # claims ended by their owner (RELEASE: a computation given up)
    "cleared",  # pages dropped by CLEAR
    "claims_cleared",  # claims ended by CLEAR
)
#: What a tenant's STATS counts of its own requests (pages asked for and found, pages sent
#: and stored, bytes sent).
_TENANT_COUNTERS = ("get_pages", "get_hits", "put_pages", "put_stored", "put_bytes")


class StoreOps:
    """The handlers of one listener over ``store`` (the caller's) and ``claims``.

    Owns the listener's counters (the transport adds its frames and bytes to
    :attr:`counters`) and its STATS report. Confined to the thread that serves the listener
    (the TCP server's event loop, or the ucx:// listener's thread), as is ``claims``.
    ``store`` is thread-safe; every call of it that may wait on disk goes through
    ``in_store`` (only ``stats()``, a read of counters, is made directly). Handlers suspend
    only in ``in_store`` and while a LOOKUP waits for a claimed key.

    ``claims``: the in-flight claim table, or None where the listener offers no claims (a
    LOOKUP is then an EXISTS that claims nothing, a RELEASE releases nothing, a CLEAR drops
    the pages only). ``on_stored(keys)`` is told of every PUT's keys (stored or not: the
    computation behind a claim on them is over either way). ``describe()``: the transport's
    own STATS fields (``url``, ``connections`` and any more).
    """

    def __init__(
        self,
        store: PageStore,
        config: ServerConfig,
        admission: Admission,
        in_store: InStore,
        describe: Callable[[], dict[str, Any]],
        claims: ClaimTable | None = None,
        on_stored: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.admission = admission
        self.auth = Authenticator.from_config(config)
        self.claims = claims
        self.counters = {"requests": 0, "bytes_in": 0, "bytes_out": 0, "refused": 0}
        if claims is not None:
            self.counters.update(dict.fromkeys(CLAIM_COUNTERS, 0))
        self._tenants: dict[str, dict[str, int]] = {}
        self._in_store = in_store
        self._describe = describe
        self._on_stored = on_stored
        self._started = time.monotonic()
        self._handlers: dict[Op, Handler] = {
            Op.HELLO: self.hello,
            Op.AUTH: self.authenticate,
            Op.SHM_ATTACH: self.shm_attach,
            Op.EXISTS: self.exists,
            Op.GET: self.get,
            Op.PUT: self.put,
            Op.STATS: self.stats,
            Op.LOOKUP: self.lookup,
            Op.RELEASE: self.release,
            Op.CLEAR: self.clear,
        }

    def handler(self, op: Op) -> Handler:
        """The handler of request op ``op``."""
        try:
            return self._handlers[op]
        except KeyError:  # validate_request lets only request ops through
            raise ProtocolError(f"unhandled op {op.name}") from None

    async def hello(self, session: Session, control: dict[str, Any], data: memoryview) -> Reply:
        nonce = session.handshake.hello(control)
        return Reply({"version": PROTOCOL_VERSION, "server": SERVER_NAME, "nonce": nonce})

    async def authenticate(
        self, session: Session, control: dict[str, Any], data: memoryview
    ) -> Reply:
        session.grant, server_proof = session.handshake.auth(control, self.auth)
        self.admission.gate.promote()
        session.authenticated = True
        spec = control.get("shm")
        segment = None if spec is None else session.create_shm(spec["size"])
        in_shm = segment is not None
        limits = self.config.limits
        return Reply(
            {
                "version": PROTOCOL_VERSION,
                "server": SERVER_NAME,
                # Over shm:// the pages cross the client's segment, not server buffers.
                "max_payload": limits.max_payload if in_shm else self.admission.max_payload(limits),
                "shm": {"name": segment[0], "size": segment[1]} if segment else False,
                "tenant": session.grant.tenant,
                "proof": server_proof,
            }
        )

    async def shm_attach(
        self, session: Session, control: dict[str, Any], data: memoryview
    ) -> Reply:
        name, size = session.create_shm(control["size"])
        return Reply({"name": name, "size": size})

    async def exists(self, session: Session, control: dict[str, Any], data: memoryview) -> Reply:
        return Reply({"present": await self._contains(session, control["keys"])})

    async def get(self, session: Session, control: dict[str, Any], data: memoryview) -> Reply:
        keys, lengths = control["keys"], control["lengths"]
        store = self.store.for_tenant(session.grant.tenant)
        views = await self._in_store(read_pages, store, keys, lengths, control.get("range"))
        sizes = [MISSING if v is None else v.nbytes for v in views]
        if session.grant.tenant is not None:
            tally = self._tenant_tally(session.grant.tenant)
            tally["get_pages"] += len(keys)
            tally["get_hits"] += sum(v is not None for v in views)
        return Reply({"sizes": sizes}, [v for v in views if v is not None])

    async def put(self, session: Session, control: dict[str, Any], data: memoryview) -> Reply:
        keys: list[bytes] = control["keys"]
        try:
            values = split_pages(data, control["sizes"])
            del data  # no view of the payload outlives the request (its buffer may be a mapping)
            store = self.store.for_tenant(session.grant.tenant)
            stored = await self._in_store(put_pages, store, keys, values)
            if session.grant.tenant is not None:
                tally = self._tenant_tally(session.grant.tenant)
                tally["put_pages"] += len(keys)
                tally["put_stored"] += sum(stored)
                tally["put_bytes"] += sum(control["sizes"])
            return Reply({"stored": stored})
        finally:
            # Stored or refused (too big), or the store failed: either way the computation
            # behind the claim is over, so its waiters look again (and claim it if missing).
            if self.claims is not None:
                self.claims.stored(keys)
            if self._on_stored is not None:
                self._on_stored(list(keys))

    async def stats(self, session: Session, control: dict[str, Any], data: memoryview) -> Reply:
        tenant = session.grant.tenant
        if tenant is None:
            return Reply({"store": asdict(self.store.stats()), "server": self.info()})
        # A tenant sees its own requests only: the store's totals and the server's process
        # would tell it about the other tenants (issue 31).
        server = {"version": PROTOCOL_VERSION, "tenant": tenant,
                  "max_payload": self.admission.max_payload(self.config.limits),
                  **self._tenant_tally(tenant)}  # fmt: skip
        own = self.store.for_tenant(tenant)
        # Its own store's totals when it has one (a quota); nothing of a store it shares.
        return Reply({"store": asdict(own.stats()) if own is not self.store else {},
                      "server": server})  # fmt: skip

    def _tenant_tally(self, tenant: str) -> dict[str, int]:
        """The counters of ``tenant``'s own GETs and PUTs (for its STATS)."""
        tally = self._tenants.get(tenant)
        if tally is None:
            tally = self._tenants[tenant] = dict.fromkeys(_TENANT_COUNTERS, 0)
        return tally

    async def lookup(self, session: Session, control: dict[str, Any], data: memoryview) -> Reply:
        if self.claims is None:
            present = await self._contains(session, control["keys"])
            return Reply({"present": present, "claimed": [False] * len(present)})
        return Reply(
            await serve_lookup(
                self.claims,
                self.counters,
                lambda keys: self._contains(session, keys),
                session,
                control,
            )
        )

    async def release(self, session: Session, control: dict[str, Any], data: memoryview) -> Reply:
        keys = control["keys"]
        if self.claims is None:
            return Reply({"released": [False] * len(keys)})
        released = [self.claims.release(key, control["owner"]) for key in keys]
        self.counters["released"] += sum(released)
        return Reply({"released": released})

    async def clear(self, session: Session, control: dict[str, Any], data: memoryview) -> Reply:
        check_clear(session.grant)
        dropped = await self._in_store(self.store.clear)
        if self.claims is not None:
            self.counters["cleared"] += dropped
            self.counters["claims_cleared"] += self.claims.clear()
        return Reply({"dropped": dropped})

    def info(self) -> dict[str, Any]:
        """The ``server`` map of a STATS reply."""
        described = self._describe()
        claims = self.claims
        claim_stats = {} if claims is None else {
            "claims_expired": claims.expired,
            "claims_held": len(claims),
        }  # fmt: skip
        return {
            "version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self._started, 3),
            **described,
            "max_payload": self.admission.max_payload(self.config.limits),
            **self.counters,
            **self.admission.stats(),
            **claim_stats,
            **self.config.info,
        }

    async def _contains(self, session: Session, keys: list[bytes]) -> list[bool]:
        store = self.store.for_tenant(session.grant.tenant)
        return await self._in_store(contains_all, store, keys)  # type: ignore[no-any-return]
