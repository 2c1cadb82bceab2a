"""How long and how much one client may hold of the gateway (issue 31, item 3).

A slow client must not hold a connection for ever, many idle ones must not exhaust the
gateway's file descriptors, and many large bodies or answers must not exhaust its memory:
nginx bounds the same things (``client_header_timeout``, ``client_body_timeout``,
``worker_connections``, its proxy buffers). The flags are the operator's; the defaults are
judgements, not measurements, and say where they come from.
"""

from __future__ import annotations

import argparse
import resource
from dataclasses import dataclass

#: nginx's ``client_header_timeout`` and ``client_body_timeout`` (60 s): long enough for any
#: client on a slow link, short enough that a stalled one gives its connection back.
DEFAULT_HEADER_TIMEOUT_S = 60.0
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Request bodies and whole answers the gateway holds at once: 64 bodies of the largest size
#: ``--max-request-bytes`` allows by default (16 MiB); a judgement.
DEFAULT_BUFFER_BUDGET_BYTES = 1 << 30
#: Descriptors one client connection may cost: its own socket and the one to the instance
#: serving it (a handoff's prefill call ends before its decode call starts).
DESCRIPTORS_PER_CLIENT = 2
#: Descriptors kept for everything else the gateway opens (store client, load polls, logs,
#: the instances' admin calls); a judgement, well above the ~40 it holds when idle.
DESCRIPTORS_KEPT = 256


def connection_cap(descriptor_limit: int) -> int:
    """Client connections a process allowed ``descriptor_limit`` open files may accept
    without running out of descriptors for its own upstream calls (at least 1)."""
    return max(1, (descriptor_limit - DESCRIPTORS_KEPT) // DESCRIPTORS_PER_CLIENT)


def raise_descriptor_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit (as SGLang's servers do);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # kept as it was: the cap is derived from what is in force
    return soft


@dataclass(frozen=True)
class ClientLimits:
    """``--client-header-timeout``, ``--client-body-timeout``, ``--max-client-connections``
    and ``--gateway-buffer-bytes``."""

    #: Seconds a client may take to send a request's head, counted from its connection or
    #: from its previous answer (so also how long an idle keep-alive connection stays open).
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    #: Seconds a client may take to send a request's whole body once its head is in.
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    #: Client connections open at once; more are answered 503 and closed. 0: derived from
    #: the open-file limit (:func:`connection_cap`).
    max_connections: int = 0
    #: Bytes of request bodies and buffered answers the gateway holds at once; a request
    #: that would go over gets 503.
    buffer_budget_bytes: int = DEFAULT_BUFFER_BUDGET_BYTES

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds: {self}")
        if self.max_connections < 0 or self.buffer_budget_bytes < 1:
            raise ValueError(f"client limits out of range: {self}")

    def connections(self, descriptor_limit: int) -> int:
        """The connection cap in force under ``descriptor_limit`` open files."""
        return self.max_connections or connection_cap(descriptor_limit)

    @staticmethod
    def add_args(group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--client-header-timeout",
            type=float,
            default=DEFAULT_HEADER_TIMEOUT_S,
            help="Seconds a client may take to send a request's headers (and an idle "
            "keep-alive connection stays open); then the gateway closes the connection "
            f"(default: {DEFAULT_HEADER_TIMEOUT_S:g}, nginx's).",
        )
        group.add_argument(
            "--client-body-timeout",
            type=float,
            default=DEFAULT_BODY_TIMEOUT_S,
            help="Seconds a client may take to send a request's body; then 408 (default: "
            f"{DEFAULT_BODY_TIMEOUT_S:g}, nginx's).",
        )
        group.add_argument(
            "--max-client-connections",
            type=int,
            default=0,
            help="Client connections the gateway keeps open at once; more are answered 503 "
            f"and closed (default 0: (open-file limit - {DESCRIPTORS_KEPT}) / "
            f"{DESCRIPTORS_PER_CLIENT}, the limit raised to its hard limit first).",
        )
        group.add_argument(
            "--gateway-buffer-bytes",
            type=int,
            default=DEFAULT_BUFFER_BUDGET_BYTES,
            help="Bytes of request bodies and whole answers the gateway holds at once; a "
            "request that would go over gets 503 (default: "
            f"{DEFAULT_BUFFER_BUDGET_BYTES >> 20} MiB).",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientLimits:
        try:
            return cls(args.client_header_timeout, args.client_body_timeout,
                       args.max_client_connections, args.gateway_buffer_bytes)  # fmt: skip
        except ValueError:
            raise ValueError(
                "--client-header-timeout and --client-body-timeout must be positive numbers "
                "of seconds, --max-client-connections 0 or more, --gateway-buffer-bytes at "
                "least 1"
            ) from None
