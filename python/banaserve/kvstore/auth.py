"""Who may use a store server, and which pages a connection can address.

Two kinds of credential, checked in HELLO by :class:`Authenticator` (in constant time: every
configured token is compared, each through SHA-256 digests of equal length, whether or not an
earlier one matched):

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

from banaserve.kvstore.protocol import PROTOCOL_VERSION, ErrorCode, ProtocolError

logger = logging.getLogger("banaserve.kvstore.auth")

#: Domain separation of tenant keyspaces (part of every mapped key: changing it orphans pages).
_TENANT_DOMAIN = b"banaserve-kv-tenant-v1"
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


class Authenticator:
    """Checks HELLO tokens. Immutable after construction, so any thread may use it."""

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

    def authenticate(self, offered: str | None) -> Grant:
        """The grant of ``offered``; ProtocolError AUTH if it matches no configured token.
        Takes the same time whichever token (if any) matches."""
        if not self.required:
            return OPEN
        digest = _digest(offered or "")
        shared = self._shared is not None and hmac.compare_digest(digest, self._shared)
        tenant = None
        for candidate, name in self._tenants:  # no early exit: the time must not tell which
            if hmac.compare_digest(digest, candidate):
                tenant = name
        if shared:
            return OPEN
        if tenant is not None:
            return Grant(tenant)
        raise ProtocolError("authentication failed: wrong or missing token", ErrorCode.AUTH)


def check_hello(control: dict[str, Any], authenticated: bool, auth: Authenticator) -> Grant:
    """Refuse a second HELLO, another protocol version, or a wrong token (ProtocolError);
    returns what the token grants. Shared by every server transport."""
    if authenticated:
        raise ProtocolError("HELLO sent twice on one connection")
    if control["version"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"client speaks protocol {control['version']}, server {PROTOCOL_VERSION}"
        )
    return auth.authenticate(control.get("token"))


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
