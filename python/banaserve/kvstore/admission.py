"""Admission: the memory a store server's peers can make it hold, bounded before it is taken.

Who can make the server allocate what, and the bound on it:

- *A connection at all*: at most ``max_connections`` authenticated ones at once per listener
  (the TCP/shm one, the ucx:// one: a :class:`ConnectionGate` each), and apart from them a
  quarter as many strangers. Over the strangers' cap a listener closes the oldest stranger to
  let the new connection in (a peer with the token sends its HELLO and AUTH at once, so idle
  strangers cannot lock it out); when every stranger is being closed already, it sends the
  new connection :attr:`ConnectionGate.busy_frame` (encoded
  once) and closes it, with nothing allocated for it.
- *A stranger* (a connection whose AUTH has not succeeded): its frames may carry a control map
  of at most :data:`PRE_AUTH_CONTROL_BYTES` and no payload (:meth:`Admission.admit_header`), so
  a stranger makes the server buffer at most ``HEADER_BYTES + PRE_AUTH_CONTROL_BYTES``, for at
  most the HELLO timeout. Strangers are not charged to the budget: the cap bounds them.
- *An authenticated request*: its control map, its socket payload and, while they are sent, a
  GET reply's pages (pinned: an eviction meanwhile cannot free them) are charged to one
  :class:`ByteBudget`, tied to the RAM capacity, *before* a buffer is allocated or a page
  pinned, and given back when the request ends however it ends (:class:`Ticket`). A request
  over its share of the budget is refused at once (TOO_LARGE); one that does not fit now waits
  up to ``wait_s`` for others to end, then is refused (BUSY). Either way its body is unread.
- *Buffers*: request buffers of :data:`MMAP_MIN_BYTES` or more are private anonymous mappings
  (:func:`request_buffer`): only the bytes actually received become resident, and the pages go
  back to the OS when the request ends. A ``bytearray`` would be zero-filled (resident at once,
  however little arrives) and, once glibc's dynamic mmap threshold has risen past its size,
  carved from malloc's heap, which freeing does not shrink.

So the server's memory is at most: the store's capacity, plus the budget, plus
``max_connections`` times a few KiB per listener, plus the claim table, plus the interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import threading
from dataclasses import dataclass, field
from typing import Any

from banaserve.kvstore.protocol import (
    ErrorCode,
    Header,
    Limits,
    ProtocolError,
    encode_error,
)

#: Connections served at once per process (every listener together).
DEFAULT_MAX_CONNECTIONS = 256
#: Largest control map before authentication: a HELLO or an AUTH is about 100 bytes.
PRE_AUTH_CONTROL_BYTES = 4 << 10
#: The command line's in-flight budget as a fraction of the RAM capacity.
DEFAULT_INFLIGHT_FRACTION = 0.25
#: The smallest in-flight budget the command line sets, whatever the capacity.
MIN_INFLIGHT_BYTES = 16 << 20
#: The in-flight budget of a server built in-process without one (as much as one max frame).
DEFAULT_INFLIGHT_BYTES = 1 << 30
#: One request may take at most 1/REQUEST_SHARE of the budget, so that several always fit.
REQUEST_SHARE = 4
#: How long a request waits for budget before it is refused BUSY.
DEFAULT_ADMISSION_WAIT_S = 2.0
#: Once its header has arrived, a frame's body must arrive within this many seconds (and a GET
#: reply's payload must leave within as long), or the connection is closed: a peer that stalls
#: mid-frame gives its budget back after this long at most.
DEFAULT_FRAME_TIMEOUT_S = 30.0
#: Request buffers at least this big are anonymous mappings (see the module docstring).
MMAP_MIN_BYTES = 256 << 10
#: Connections turned away at once (each holds a socket for a moment); past this, closed bare.
MAX_TURNING_AWAY = 64


def inflight_budget(capacity_bytes: int, fraction: float = DEFAULT_INFLIGHT_FRACTION) -> int:
    """The in-flight budget of a store of ``capacity_bytes`` RAM: ``fraction`` of it, at least
    :data:`MIN_INFLIGHT_BYTES`."""
    if fraction <= 0:
        raise ValueError(f"in-flight fraction must be positive, got {fraction}")
    return max(MIN_INFLIGHT_BYTES, int(capacity_bytes * fraction))


def request_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A zeroed, writable buffer of ``nbytes`` for one request; the caller drops every reference
    (and every view of it) when the request ends, which unmaps a mapping at once."""
    if nbytes >= MMAP_MIN_BYTES:
        # fileno -1 adds MAP_ANONYMOUS; private, so it is not shmem and dies with its last view.
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return bytearray(nbytes)


#: What the oldest stranger is told when it is closed to let a new connection in.
EVICTED_MESSAGE = "closed to make room: too many unauthenticated connections"


class ConnectionGate:
    """At most ``limit`` authenticated connections and ``strangers`` unauthenticated ones at
    once, counted apart: strangers holding connections cannot lock out the peers that have
    the token (issue 31). A connection enters as a stranger (:meth:`try_enter`) and becomes
    an authenticated one when its AUTH succeeds (:meth:`promote`). Thread-safe (a lock
    around a few integers)."""

    def __init__(self, limit: int = DEFAULT_MAX_CONNECTIONS, strangers: int | None = None) -> None:
        if limit <= 0:
            raise ValueError(f"max connections must be positive, got {limit}")
        self.limit = limit
        self.stranger_limit = strangers if strangers is not None else max(1, limit // 4)
        if self.stranger_limit <= 0:
            raise ValueError(f"max strangers must be positive, got {self.stranger_limit}")
        self.open = 0
        self.strangers = 0
        self.accepted = 0
        self.turned_away = 0
        self._lock = threading.Lock()
        self.busy_message = (
            f"too many connections: this store serves at most {limit} at once and "
            f"{self.stranger_limit} not yet authenticated; retry later"
        )
        #: The ERROR frame a connection over the cap gets (request id 0: it sent nothing yet).
        self.busy_frame = encode_error(0, ErrorCode.BUSY, self.busy_message)

    def try_enter(self) -> bool:
        """Count one new (unauthenticated) connection in; False (and counted as turned away)
        when the strangers' cap is reached."""
        with self._lock:
            self.accepted += 1
            if self.strangers >= self.stranger_limit:
                self.turned_away += 1
                return False
            self.strangers += 1
            return True

    def enter_in_place(self) -> None:
        """Count one new stranger in over the cap, in place of one being closed for it (it
        leaves when its task ends)."""
        with self._lock:
            self.strangers += 1
            self.turned_away -= 1  # try_enter counted it, but it was let in

    def promote(self) -> None:
        """A stranger let in by :meth:`try_enter` has authenticated; ProtocolError BUSY (and
        it stays a stranger) when the authenticated cap is reached."""
        with self._lock:
            if self.open >= self.limit:
                self.turned_away += 1
                raise ProtocolError(
                    f"too many connections: this store serves at most {self.limit} "
                    "authenticated connections at once; retry later",
                    ErrorCode.BUSY,
                )
            self.strangers -= 1
            self.open += 1

    def leave(self, authenticated: bool) -> None:
        """One connection let in by :meth:`try_enter` has ended (``authenticated``: it was
        promoted)."""
        with self._lock:
            if authenticated:
                self.open -= 1
            else:
                self.strangers -= 1


class ByteBudget:
    """Bytes that requests may hold in server buffers at once, across every connection and
    listener of a process.

    Thread-safe: one lock, held for a few integer operations. Nothing here blocks a thread;
    :meth:`take` suspends only the asyncio task that calls it. A release on any thread (the
    ucx:// listener's) wakes the asyncio waiters through their loop.
    """

    def __init__(self, total: int = DEFAULT_INFLIGHT_BYTES) -> None:
        if total <= 0:
            raise ValueError(f"in-flight budget must be positive, got {total}")
        self.total = total
        #: The most one request may hold; AUTH's reply tells clients so they split bigger batches.
        self.request_cap = max(1, total // REQUEST_SHARE)
        self.in_use = 0
        self.peak = 0
        self.busy = 0  # requests refused because the budget stayed full
        self.waits = 0  # requests that had to wait for budget
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def check_share(self, nbytes: int, what: str) -> None:
        """TOO_LARGE if one request of ``nbytes`` could never be admitted."""
        if nbytes > self.request_cap:
            raise ProtocolError(
                f"{what} needs {nbytes} bytes of server buffers, over the {self.request_cap} one "
                f"request may hold (1/{REQUEST_SHARE} of the store's in-flight budget of "
                f"{self.total}; "
                "AUTH's max_payload says how to split a batch)",
                ErrorCode.TOO_LARGE,
            )

    def try_take(self, nbytes: int) -> bool:
        with self._lock:
            return self._take_locked(nbytes)

    def _take_locked(self, nbytes: int) -> bool:
        if self.in_use + nbytes > self.total:
            return False
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        return True

    def give(self, nbytes: int) -> None:
        """Return bytes taken before; wakes every waiter to try again."""
        with self._lock:
            self.in_use -= nbytes
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits there
                loop.call_soon_threadsafe(_wake, future)

    async def take(self, nbytes: int, wait_s: float, what: str) -> None:
        """Take ``nbytes``, waiting up to ``wait_s`` seconds for room; BUSY (ProtocolError)
        if there is none by then. Waiters are not queued in order: each retries on every
        release, so a small request can pass a big one (which then may time out)."""
        self.check_share(nbytes, what)
        if self.try_take(nbytes):
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        self.note_wait()
        while True:
            future: asyncio.Future[None] = loop.create_future()
            with self._lock:
                if self._take_locked(nbytes):
                    return
                # Registered under the lock that give() empties the list under: no lost wake-up.
                self._waiters.append((loop, future))
            left = deadline - loop.time()
            try:
                if left <= 0:
                    break
                await asyncio.wait_for(future, left)
            except asyncio.TimeoutError:
                pass  # one more try above, then the deadline has passed
            finally:
                self._forget(future)
        raise self.refusal(nbytes, wait_s, what)

    def note_wait(self) -> None:
        """Count one request that had to wait for budget."""
        with self._lock:
            self.waits += 1

    def refusal(self, nbytes: int, wait_s: float, what: str) -> ProtocolError:
        """The BUSY error for a request that waited ``wait_s`` in vain (counted here)."""
        with self._lock:
            self.busy += 1
        return ProtocolError(
            f"store busy: {what} needs {nbytes} bytes of server buffers, and the in-flight "
            f"budget of {self.total} bytes stayed full for {wait_s:g} s; retry later",
            ErrorCode.BUSY,
        )

    def _forget(self, future: asyncio.Future[None]) -> None:
        with self._lock:
            self._waiters = [w for w in self._waiters if w[1] is not future]

    def stats(self) -> dict[str, int]:
        return {
            "inflight_budget": self.total,
            "inflight_bytes": self.in_use,
            "inflight_peak": self.peak,
            "busy": self.busy,
            "budget_waits": self.waits,
        }


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Ticket:
    """The bytes of a :class:`ByteBudget` one request holds. Owned by whoever serves that
    request (one task, or the ucx:// thread); :meth:`release` is idempotent and must run
    however the request ends."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.held = 0

    async def take(self, nbytes: int, wait_s: float, what: str) -> None:
        """Hold ``nbytes`` more (see :meth:`ByteBudget.take`); the request's whole holding
        must stay within one request's share."""
        if nbytes <= 0:
            return
        self.budget.check_share(self.held + nbytes, what)
        await self.budget.take(nbytes, wait_s, what)
        self.held += nbytes

    def try_take(self, nbytes: int, what: str) -> bool:
        """Hold ``nbytes`` more if they fit now (TOO_LARGE if they never can)."""
        if nbytes <= 0:
            return True
        self.budget.check_share(self.held + nbytes, what)
        if not self.budget.try_take(nbytes):
            return False
        self.held += nbytes
        return True

    def release(self) -> None:
        held, self.held = self.held, 0
        if held:
            self.budget.give(held)


@dataclass
class Admission:
    """The bounds a listener applies (see the module docstring). The listeners of one process
    share one budget; each has a gate of its own. Thread-safe, as its parts are."""

    gate: ConnectionGate = field(default_factory=ConnectionGate)
    budget: ByteBudget = field(default_factory=ByteBudget)
    wait_s: float = DEFAULT_ADMISSION_WAIT_S
    frame_timeout: float = DEFAULT_FRAME_TIMEOUT_S

    def max_payload(self, limits: Limits) -> int:
        """The payload one frame may carry, as AUTH's reply tells clients: the frame limit, or one
        request's share of the budget less a largest control map, whichever is smaller."""
        return max(1, min(limits.max_payload, self.budget.request_cap - limits.max_control))

    def admit_header(self, header: Header, authenticated: bool) -> int:
        """Bytes the frame's control map and socket payload need from the budget (0 for a
        stranger's, which the connection cap bounds instead). Raises ProtocolError for a
        frame that may not be buffered at all; nothing has been allocated for it yet."""
        if not authenticated:
            if header.control_len > PRE_AUTH_CONTROL_BYTES:
                raise ProtocolError(
                    f"control map of {header.control_len} bytes before authentication: at most "
                    f"{PRE_AUTH_CONTROL_BYTES} until AUTH succeeds",
                    ErrorCode.TOO_LARGE,
                )
            if header.payload_len:
                raise ProtocolError(
                    f"{header.payload_len} payload bytes before authentication: none until "
                    "HELLO succeeds"
                )
            return 0
        need = header.control_len + header.payload_len
        self.budget.check_share(need, header.op.name)
        return need

    def stats(self) -> dict[str, Any]:
        return {
            "max_connections": self.gate.limit,
            "max_strangers": self.gate.stranger_limit,
            "accepted": self.gate.accepted,
            "turned_away": self.gate.turned_away,
            **self.budget.stats(),
        }
