"""One ucx:// connection's state on the server (:mod:`banaserve.kvstore.server.ucx`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from banaserve.kvstore.admission import Admission, Ticket
from banaserve.kvstore.auth import OPEN, Grant, Handshake
from banaserve.kvstore.protocol import HEADER_BYTES, ErrorCode, Header, ProtocolError


class UcxConn:
    """One client endpoint and where its current frame stands. Touched only by the server
    thread. Buffers given to UCX stay referenced here (``recv``, ``sends``) until their request is
    complete."""

    def __init__(self, conn_id: int, ep: Any, hello_deadline: float, admitted: bool) -> None:
        self.id = conn_id
        self.ep = ep
        #: Counted in the connection gate (not a connection turned away at the cap).
        self.admitted = admitted
        self.authenticated = False
        self.grant: Grant = OPEN
        self.handshake = Handshake()
        #: Never set: without endpoint error handling the server does not see a peer die, and
        #: nothing waits on a ucx:// connection's behalf (no claims here).
        self.gone = False
        self.hello_deadline = hello_deadline
        #: The current request's share of the budget, and those of earlier requests whose
        #: replies are still being sent (their pages pinned): released once sent.
        self.ticket: Ticket | None = None
        self.sent_tickets: list[Ticket] = []
        #: When the current frame's body must have arrived, and its reply's payload left
        #: (the frame timeout): a peer that stalls gives its budget back then.
        self.frame_deadline: float | None = None
        self.reply_deadline: float | None = None
        #: Budget the current request waits for: (bytes, what for, then, deadline).
        self.wanted: tuple[int, str, Callable[[], None], float] | None = None
        self.header_buf = bytearray(HEADER_BYTES)
        self.header: Header | None = None
        self.control: dict[str, Any] | None = None
        self.body: Any = None
        self.payload: Any = None
        self.recv: list[Any] = []  # receives of the current phase
        self.sends: list[tuple[Any, Any]] = []  # (request, buffer kept alive)
        self.bye: Any = None
        self.bye_buf = bytearray(1)
        self.closing_deadline: float | None = None  # set once refused: close when sent

    @property
    def shm_size(self) -> int | None:
        return None

    def create_shm(self, size: int) -> tuple[str, int]:
        raise ProtocolError("AUTH: shared memory is not offered over ucx://", ErrorCode.SHM)

    def watch_eof(self, on_gone: Callable[[], None]) -> Callable[[], None]:
        raise NotImplementedError("nothing waits on a ucx:// connection's behalf")

    def settled(self) -> bool:
        """Whether UCX is done with every buffer of this connection (after its close)."""
        requests = [*self.recv, *(r for r, _ in self.sends), self.bye]
        return all(r is None or r.completed for r in requests)

    def want(self, admission: Admission, nbytes: int, what: str, then: Callable[[], None]) -> None:
        """Take ``nbytes`` of budget for the current request, then call ``then``; if they do
        not fit now, the connection waits (no receive posted) and :meth:`retry_budget` tries
        again on each pass of the server thread. TOO_LARGE (ProtocolError) if they never fit."""
        assert self.ticket is not None
        if self.ticket.try_take(nbytes, what):
            then()
            return
        admission.budget.note_wait()
        self.wanted = (nbytes, what, then, time.monotonic() + admission.wait_s)

    def retry_budget(self, admission: Admission, now: float) -> bool:
        """Whether the budget :meth:`want` waits for came (``then`` has run); BUSY
        (ProtocolError) once the wait is over."""
        assert self.wanted is not None and self.ticket is not None
        nbytes, what, then, deadline = self.wanted
        if self.ticket.try_take(nbytes, what):
            self.wanted = None
            then()
            return True
        if now > deadline:
            self.wanted = None
            raise admission.budget.refusal(nbytes, admission.wait_s, what)
        return False

    def release_budget(self) -> None:
        for ticket in (self.ticket, *self.sent_tickets):
            if ticket is not None:
                ticket.release()
        self.sent_tickets.clear()


def settle(conn: UcxConn) -> bool:
    """Whether UCX is done with a closed connection's buffers; then its budget goes back."""
    if not conn.settled():
        return False
    conn.release_budget()
    return True
