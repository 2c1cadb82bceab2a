"""Client transports, chosen by URL scheme: ``tcp://``, ``shm://`` (same host), ``ucx://``."""

from __future__ import annotations

from banaserve.kvstore.transport.base import (
    Address,
    KvStoreAuthError,
    KvStoreError,
    KvStoreRemoteError,
    Sink,
    Transport,
    parse_url,
)


def open_transport(address: Address, timeout: float) -> Transport:
    """An unconnected transport for ``address``; call ``connect(token)`` on it.

    Raises KvStoreError for a scheme this install cannot serve (``ucx://`` without ucxx).
    """
    if address.scheme == "tcp":
        from banaserve.kvstore.transport.tcp import TcpTransport

        return TcpTransport(address, timeout)
    if address.scheme == "shm":
        from banaserve.kvstore.transport.shm import ShmTransport

        return ShmTransport(address, timeout)
    from banaserve.kvstore.transport.ucx import open_ucx

    return open_ucx(address, timeout)


__all__ = [
    "Address",
    "KvStoreAuthError",
    "KvStoreError",
    "KvStoreRemoteError",
    "Sink",
    "Transport",
    "open_transport",
    "parse_url",
]
