"""What every client transport offers, the errors they raise, and store URLs."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from banaserve.kvstore.auth import check_server_proof, client_proof
from banaserve.kvstore.protocol import NONCE_BYTES, PROTOCOL_VERSION, Op, ProtocolError

SCHEMES = ("tcp", "shm", "ucx")

#: Given a reply's control map, the caller's buffers its payload goes into, in order; their
#: sizes add up to exactly the payload the control map declares.
Sink = Callable[[dict[str, Any]], Sequence[memoryview]]


class KvStoreError(Exception):
    """A KV store failure the caller must see (not a down shard, which is a miss)."""


class KvStoreAuthError(KvStoreError):
    """The server refused this client's token."""


class KvStoreRemoteError(KvStoreError):
    """The server answered with an ERROR reply; ``code`` is a :class:`ErrorCode` value."""

    def __init__(self, url: str, code: str, message: str) -> None:
        super().__init__(f"kv store at {url}: {message}")
        self.url = url
        self.code = code
        self.remote_message = message


@dataclass(frozen=True)
class Address:
    """A parsed store URL ``scheme://host:port``."""

    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def endpoint(self) -> str:
        """``host:port``: the server's identity whatever the transport (placement uses it)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_url(url: str) -> Address:
    """``tcp://host:port``, ``shm://host:port`` or ``ucx://host:port``; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"kv store URL {url!r}: scheme must be one of {', '.join(SCHEMES)}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"kv store URL {url!r}: expected {parts.scheme}://host:port")
    return Address(parts.scheme, parts.hostname, port)


class Transport(ABC):
    """One connection to one store server.

    Not thread-safe: one thread drives a transport at a time (the client's per-shard pool hands
    each transport to a single caller). Every method blocks for at most ``timeout`` seconds per
    socket operation. Connection trouble surfaces as ``OSError`` (refused, reset, timed out)
    after which the transport is closed; an ERROR reply raises :class:`KvStoreRemoteError` (or
    :class:`KvStoreAuthError`) and the server has closed the connection; a malformed reply
    raises ``ProtocolError``. Payload buffers are never retained past the call that got them.
    """

    address: Address
    #: The server's payload limit per frame, known once connected.
    max_payload: int

    @abstractmethod
    def connect(self, token: str | None) -> dict[str, Any]:
        """Open the connection and authenticate (HELLO, AUTH); returns the server's AUTH
        reply."""

    def _auth_control(self, proof: bytes | None) -> dict[str, Any]:
        """The AUTH control map; transports add what they negotiate (shm adds its segment)."""
        return {"proof": proof}

    def _authenticate(self, token: str | None) -> dict[str, Any]:
        """HELLO and AUTH on a freshly opened connection (the token itself never travels),
        and check that the server holds the token too; close the connection if any of that
        fails. Returns the server's AUTH reply."""
        try:
            nonce = os.urandom(NONCE_BYTES)
            client = f"pid {os.getpid()} {self.address.scheme}"
            hello = {"version": PROTOCOL_VERSION, "nonce": nonce, "client": client}
            server_nonce = self.request(Op.HELLO, hello)["nonce"]
            mine = None if token is None else client_proof(token, nonce, server_nonce)
            reply = self.request(Op.AUTH, self._auth_control(mine))
            try:
                check_server_proof(token, nonce, server_nonce, reply.get("proof"))
            except ProtocolError as exc:
                raise KvStoreAuthError(f"kv store at {self.address.url}: {exc}") from None
        except BaseException:
            self.close()
            raise
        self.max_payload = reply["max_payload"]
        return reply

    @abstractmethod
    def request(
        self,
        op: Op,
        control: dict[str, Any],
        payload: Sequence[memoryview] = (),
        sink: Sink | None = None,
        reply_capacity: int = 0,
    ) -> dict[str, Any]:
        """Send one request and wait for its reply; returns the reply's control map.

        ``payload`` views (flat, byte format) are sent in order after the control map and are
        only read. A reply payload is written straight into the views ``sink`` returns.
        ``reply_capacity`` is the most payload bytes the reply may carry (shm sizes its segment
        by it before sending).
        """

    @abstractmethod
    def close(self) -> None:
        """Close the connection and release its resources; idempotent, never raises."""

    @property
    @abstractmethod
    def connected(self) -> bool:
        """Whether the transport holds an open connection."""
