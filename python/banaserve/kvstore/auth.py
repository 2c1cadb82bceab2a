"""Who may use a store server, and which pages a connection can address.

Two kinds of credential, checked in AUTH by :class:`Authenticator` (in constant time: the
client's proof is compared with the one of every configured token, whether or not an earlier
one matched). No token travels: after HELLO has exchanged a fresh nonce each way, the client
sends an HMAC of both nonces keyed by its token's SHA-256 and the server answers with its own
(:func:`proof`), so a client also knows it reached a server that holds the token, not a process
that took the store's port while it restarted:

- the *shared* token (``--token`` or ``$BANASERVE_KV_STORE_TOKEN``): the operator's credential.
  Keys are used as the client sends them, so the namespace (model, layout, tenant) is the one
  the client chose when it chained its keys (:mod:`banaserve.kvstore.keys`). It reaches every
  page whose key it can name.
- a *tenant* token (``--tenant-tokens FILE``, lines ``tenant:token``): grants exactly one
  tenant's keyspace. The server maps every key such a connection sends (PUT, GET, EXISTS,
  LOOKUP, RELEASE) to ``sha256(domain, tenant, key)`` (:meth:`Grant.map_keys`) before the store
  or the claim table sees it, so a tenant cannot read, probe, overwrite or claim another
  tenant's pages even with their exact keys: it can only ever name keys of its own keyspace.
  Nor may it CLEAR the store (:func:`check_clear`).

With neither configured, anyone who reaches the port may use the store (the command line allows
that only on a loopback address, or with ``--insecure``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from banaserve.kvstore.protocol import NONCE_BYTES, PROTOCOL_VERSION, ErrorCode, ProtocolError

logger = logging.getLogger("banaserve.kvstore.auth")

#: Domain separation of tenant keyspaces (part of every mapped key: changing it orphans pages).
_TENANT_DOMAIN = b"banaserve-kv-tenant-v1"
#: Domain separation of AUTH proofs, and which side a proof is from (so one side's proof is
#: never the other's).
_PROOF_DOMAIN = b"banaserve-kv-auth-v1"
CLIENT = b"client"
SERVER = b"server"
#: Tokens shorter than this are accepted with a warning: they can be guessed.
MIN_TOKEN_CHARS = 16
MAX_TENANT_CHARS = 256


class Grant:
    """What one authenticated connection may address. ``tenant`` None: keys as sent (the shared
    token, or a store without authentication); else that tenant's keyspace only. Immutable."""

    __slots__ = ("tenant", "_prefix")

    def __init__(self, tenant: str | None = None) -> None:
        self.tenant = tenant
        self._prefix: Any = None
        if tenant is not None:
            data = tenant.encode()
            self._prefix = hashlib.sha256(_TENANT_DOMAIN + struct.pack("<Q", len(data)) + data)

    def map_keys(self, keys: list[bytes]) -> list[bytes]:
        """The store keys of ``keys`` for this grant: the same list for the shared keyspace,
        else new 32-byte keys that no other tenant reaches by sending keys of its own (nor the
        shared token, short of computing them on purpose)."""
        if self._prefix is None:
            return keys
        out = []
        for key in keys:
            h = self._prefix.copy()
            h.update(key)
            out.append(h.digest())
        return out

    def __repr__(self) -> str:
        return f"Grant(tenant={self.tenant!r})"


OPEN = Grant()


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def proof(token_digest: bytes, side: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What ``side`` (:data:`CLIENT` or :data:`SERVER`) sends in AUTH to show it holds the
    token whose SHA-256 is ``token_digest``: an HMAC of both nonces, so it is good for this
    connection only and tells a listener nothing it can replay or use elsewhere."""
    message = _PROOF_DOMAIN + side + client_nonce + server_nonce
    return hmac.new(token_digest, message, hashlib.sha256).digest()


def client_proof(token: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return proof(_digest(token), CLIENT, client_nonce, server_nonce)


def check_server_proof(
    token: str | None, client_nonce: bytes, server_nonce: bytes, offered: bytes | None
) -> None:
    """Refuse (ProtocolError AUTH) a server that did not prove it holds ``token``: whatever
    answers on the store's port may be another process that took it while the store
    restarted. Without a token there is nothing to check."""
    if token is None:
        return
    expected = proof(_digest(token), SERVER, client_nonce, server_nonce)
    if offered is None or not hmac.compare_digest(offered, expected):
        raise ProtocolError(
            "the server did not prove it holds the store's token: not the store it claims to "
            "be (another process on its port?), or one started without a token",
            ErrorCode.AUTH,
        )


class Authenticator:
    """Checks AUTH proofs. Immutable after construction, so any thread may use it."""

    def __init__(self, token: str | None = None, tenant_tokens: Mapping[str, str] | None = None):
        tenant_tokens = dict(tenant_tokens or {})
        for tenant, tenant_token in tenant_tokens.items():
            if not tenant or len(tenant) > MAX_TENANT_CHARS or ":" in tenant or "\0" in tenant:
                raise ValueError(f"bad tenant name {tenant!r}: 1 to 256 chars, no ':' or NUL")
            if not tenant_token:
                raise ValueError(f"tenant {tenant!r} has an empty token")
        tokens = [t for t in (token, *tenant_tokens.values()) if t]
        if len(set(tokens)) != len(tokens):
            raise ValueError("a token is given twice (shared token or tenants): each must differ")
        self._shared = _digest(token) if token else None
        self._tenants = [(_digest(t), tenant) for tenant, t in tenant_tokens.items()]
        self.tenants = frozenset(tenant_tokens)

    @classmethod
    def from_config(cls, config: Any) -> Authenticator:
        """From an object with ``token`` and optionally ``tenant_tokens`` (a ServerConfig)."""
        return cls(config.token, getattr(config, "tenant_tokens", None))

    @property
    def required(self) -> bool:
        """Whether a token is needed at all."""
        return self._shared is not None or bool(self._tenants)

    def authenticate(
        self, offered: bytes | None, client_nonce: bytes, server_nonce: bytes
    ) -> tuple[Grant, bytes | None]:
        """The grant of the token the client's proof ``offered`` shows, and the server's
        proof of holding that token (None for a store without tokens); ProtocolError AUTH
        if it shows none. Takes the same time whichever token (if any) matches."""
        if not self.required:
            return OPEN, None
        candidates = [(self._shared, None)] if self._shared is not None else []
        matched: tuple[bytes, str | None] | None = None
        for digest, tenant in [*candidates, *self._tenants]:  # no early exit: time tells none
            expected = proof(digest, CLIENT, client_nonce, server_nonce)
            if hmac.compare_digest(offered or b"", expected):
                matched = (digest, tenant)
        if matched is None:
            raise ProtocolError("authentication failed: wrong or missing token", ErrorCode.AUTH)
        digest, tenant = matched
        grant = OPEN if tenant is None else Grant(tenant)
        return grant, proof(digest, SERVER, client_nonce, server_nonce)


class Handshake:
    """One connection's way through HELLO and AUTH, on the server. Not thread-safe: owned by
    the connection, used from the thread that serves it."""

    def __init__(self) -> None:
        self.nonces: tuple[bytes, bytes] | None = None  # (client's, server's) after HELLO
        self.done = False

    def hello(self, control: dict[str, Any]) -> bytes:
        """Refuse a second HELLO or another protocol version (ProtocolError); returns the
        server's nonce."""
        if self.nonces is not None:
            raise ProtocolError("HELLO sent twice on one connection")
        if control["version"] != PROTOCOL_VERSION:
            raise ProtocolError(
                f"client speaks protocol {control['version']}, server {PROTOCOL_VERSION}"
            )
        self.nonces = (control["nonce"], os.urandom(NONCE_BYTES))
        return self.nonces[1]

    def auth(self, control: dict[str, Any], auth: Authenticator) -> tuple[Grant, bytes | None]:
        """Refuse AUTH before HELLO or twice, or a wrong proof (ProtocolError); returns what
        the token grants and the server's proof."""
        if self.nonces is None or self.done:
            raise ProtocolError("AUTH must follow HELLO, once")
        granted = auth.authenticate(control.get("proof"), *self.nonces)
        self.done = True
        return granted


def check_clear(grant: Grant) -> None:
    """Refuse CLEAR (ProtocolError AUTH) to a tenant token. Refused rather than limited to the
    tenant's pages: a stored page does not record whose keyspace it is in (its key is a hash),
    so the server cannot tell a tenant's pages from the others'. Shared by every transport."""
    if grant.tenant is not None:
        raise ProtocolError(
            f"CLEAR needs the shared token: tenant {grant.tenant!r} may not clear the store",
            ErrorCode.AUTH,
        )


def map_control_keys(control: dict[str, Any], grant: Grant) -> dict[str, Any]:
    """Map a validated request's ``keys`` (if it has any) into ``grant``'s keyspace, in place."""
    if grant.tenant is not None and "keys" in control:
        control["keys"] = grant.map_keys(control["keys"])
    return control


def load_tenant_tokens(path: str | os.PathLike[str]) -> dict[str, str]:
    """Parse a tenant-token file: one ``tenant:token`` per line; blank lines and lines starting
    with ``#`` are skipped; whitespace around either part is dropped. ValueError on a
    malformed line or a tenant given twice. Warns when others may read the file, or a token
    is short."""
    file = Path(path)
    mode = file.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "tenant-token file %s is readable by other users (mode %o): chmod 600 it",
            file,
            stat.S_IMODE(mode),
        )
    tokens: dict[str, str] = {}
    for number, raw in enumerate(file.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, token = (part.strip() for part in line.partition(":"))
        if not sep or not tenant or not token:
            raise ValueError(f"{file}:{number}: expected 'tenant:token'")
        if tenant in tokens:
            raise ValueError(f"{file}:{number}: tenant {tenant!r} given twice")
        if len(token) < MIN_TOKEN_CHARS:
            logger.warning("%s:%d: tenant %r has a short token (< %d chars)", file, number,
                           tenant, MIN_TOKEN_CHARS)  # fmt: skip
        tokens[tenant] = token
    return tokens
