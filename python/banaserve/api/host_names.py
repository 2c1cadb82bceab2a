"""Which names a server answers to in the ``Host`` header (DNS rebinding).

A page on any site can make the user's browser resolve its own name to 127.0.0.1 and then
send requests to a server on loopback with ``Host: evil.example``; checking the name closes
that door. A server bound to loopback answers to the loopback names only; one bound to any
other address is reached by names it cannot know, so it answers to every name unless the
user lists them (``--allowed-hosts``). Pure code: the gateway and the instances adapt it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from banaserve.api.request_limits import RequestRejected

#: The names of this machine's loopback interface.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_host_names(bind_host: str, listed: Sequence[str] = ()) -> frozenset[str] | None:
    """The names a server bound to ``bind_host`` answers to; None: any name. ``listed``:
    the names the user allowed (``--allowed-hosts``), loopback's always added."""
    names = [name.strip().lower().strip("[]") for name in listed if name.strip()]
    if not names and not is_loopback(bind_host):
        return None
    return frozenset([*LOOPBACK_NAMES, bind_host.lower().strip("[]"), *names])


def host_name(header: str) -> str:
    """The name of a ``Host`` header: without its port, an IPv6 address without brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def check_host(header: str | None, allowed: frozenset[str] | None) -> None:
    """RequestRejected (400) when ``header`` names a host not in ``allowed``. No header at
    all passes: browsers always send one, and HTTP/1.0 clients may not."""
    if allowed is None or header is None or host_name(header) in allowed:
        return
    raise RequestRejected(
        400,
        f"this server does not answer to the host name {host_name(header)!r} (the Host header); "
        "list the names it is reached by with --allowed-hosts",
    )
