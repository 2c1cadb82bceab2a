"""``python -m banaserve.kvstore.server``: one store shard from the command line.

Secure by default: a store that would be reachable from other hosts without a token, or whose
ucx:// listener would listen beyond ``--host``, refuses to start (:func:`exposure_problems`)
unless ``--insecure`` says the operator accepts it, which is then logged loudly.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

from banaserve.env import TENANT_TOKENS_ENV, TOKEN_ENV
from banaserve.kvstore.admission import (
    DEFAULT_INFLIGHT_FRACTION,
    DEFAULT_MAX_CONNECTIONS,
    PRE_AUTH_CONTROL_BYTES,
    ConnectionGate,
    inflight_budget,
)
from banaserve.kvstore.auth import load_tenant_tokens
from banaserve.kvstore.claims import CLAIM_BYTES, DEFAULT_MAX_CLAIMS
from banaserve.kvstore.protocol import Limits
from banaserve.kvstore.server.heap import keep_freed_memory
from banaserve.kvstore.server.ops import ServerConfig
from banaserve.kvstore.server.tcp import KvStoreServer
from banaserve.kvstore.server.tenant_stores import build_tenant_stores
from banaserve.kvstore.storage.base import PageStore

logger = logging.getLogger("banaserve.kvstore.server")

GiB = 1 << 30

_SECURITY = [
    "Whoever can open a connection to the port and prove it holds the token (AUTH) can read, "
    "probe and overwrite pages (KV caches are prompts in another form). So:",
    f"Authentication: the shared token (--token, or better ${TOKEN_ENV}: argv is visible to "
    "other users) lets a client use its keys as it sends them: the keyspace it chose (model, "
    f'layout, tenant). Per-tenant tokens (--tenant-tokens FILE of "tenant:token" lines, or '
    f"${TENANT_TOKENS_ENV}=FILE) each grant exactly one tenant's keyspace: the server maps "
    "every key such a client sends into that tenant's keyspace, so a tenant cannot read, probe "
    "or overwrite another tenant's pages even with their exact keys. Tokens are compared in "
    "constant time.",
    "Exposure: every listener binds --host (default 127.0.0.1: this host only). Without a "
    "token the store refuses to listen on a non-loopback address. ucx:// (--ucx-port) cannot "
    "bind one address (ucxx listens on every interface), so it needs --host 0.0.0.0 (or ::). "
    "--insecure starts anyway, with a loud warning. Without a token on loopback any local user "
    "can use the store: set one on a shared machine.",
    "Memory is bounded before it is allocated: at most --max-connections connections per "
    "listener (more are answered BUSY and closed); before AUTH a connection may send "
    f"{PRE_AUTH_CONTROL_BYTES} bytes of control map and no payload; every request's buffers "
    "come from one in-flight budget of --inflight-fraction x --capacity-gb (a request over its "
    "share is refused TOO_LARGE; one that does not fit waits briefly, then is refused BUSY; "
    "either before its body is read). Memory stays near capacity x (1 + fraction) plus the "
    "interpreter.",
]


def _description() -> str:
    intro, *points = _SECURITY
    lines = [textwrap.fill("Security model. " + intro, 92)]
    lines += [textwrap.fill(p, 92, initial_indent="  * ", subsequent_indent="    ") for p in points]
    return "BanaServe global KV cache store server (one shard).\n\n" + "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m banaserve.kvstore.server",
        description=_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one")
    parser.add_argument(
        "--host",
        default=ServerConfig.host,
        help="address every listener binds (default: %(default)s, this host only; 0.0.0.0: all "
        "interfaces, which needs a token)",
    )
    parser.add_argument("--capacity-gb", type=float, required=True, help="RAM tier capacity")
    parser.add_argument("--ssd-dir", default=None, help="directory of the SSD tier (optional)")
    parser.add_argument("--ssd-capacity-gb", type=float, default=0.0, help="SSD tier capacity")
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"shared token clients must present (default: ${TOKEN_ENV}, which is better: argv "
        "is visible to other users); grants the keyspace a client chooses",
    )
    parser.add_argument(
        "--tenant-tokens",
        metavar="FILE",
        default=os.environ.get(TENANT_TOKENS_ENV),
        help=f"file of 'tenant:token' lines (default: ${TENANT_TOKENS_ENV}); each token grants "
        "only its tenant's keyspace, enforced by the server. chmod 600 it",
    )
    parser.add_argument(
        "--tenant-quota-gb",
        type=float,
        default=None,
        help="RAM each tenant of --tenant-tokens gets for its pages, in a store of its own (and "
        "the same fraction of the SSD tier), so that no tenant evicts another's pages; the "
        "shared token's keyspace gets the rest (default: an equal share for each tenant and "
        "the shared token)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="start even where the store would be exposed (no token off loopback; ucx:// beyond "
        "--host); logged as a warning",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections served at once by each listener (tcp:// and shm:// together, ucx://); "
        "more are refused BUSY (default: %(default)s)",
    )
    parser.add_argument(
        "--inflight-fraction",
        type=float,
        default=DEFAULT_INFLIGHT_FRACTION,
        help="bytes of request buffers across all connections, as a fraction of --capacity-gb "
        "(at least 16 MiB; one request may take a quarter of it) (default: %(default)s)",
    )
    parser.add_argument(
        "--max-payload-mb",
        type=int,
        default=Limits().max_payload >> 20,
        help="largest payload of one frame, in MiB (default: %(default)s)",
    )
    parser.add_argument(
        "--ucx-port",
        type=int,
        default=None,
        help="also serve ucx:// on this port (0: the TCP port + 1); needs banaserve[ucx] and "
        "--host 0.0.0.0 (see above)",
    )
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    return parser


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this host's loopback only (every address it resolves to)."""
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    addresses = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    return bool(addresses) and all(a.is_loopback for a in addresses)


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` means every interface (``0.0.0.0``, ``::`` or empty)."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def exposure_problems(host: str, authenticated: bool, ucx: bool) -> list[str]:
    """Why serving as asked would expose the store beyond what was asked; empty if it would not.

    ``authenticated``: a token (shared or per tenant) is required. ``ucx``: a ucx:// listener
    runs too.
    """
    problems = []
    if not authenticated and not is_loopback(host):
        problems.append(
            f"no token while listening on {host!r}, which other hosts may reach: anyone there "
            f"could read and overwrite every page. Set ${TOKEN_ENV} (or --tenant-tokens), or "
            "bind 127.0.0.1"
        )
    if ucx and not is_wildcard(host):
        problems.append(
            f"ucx:// cannot bind {host!r}: ucxx's listener takes a port only and listens on "
            "every interface, beyond --host. Use --host 0.0.0.0 with a token, or tcp:// and "
            "shm:// only"
        )
    return problems


def check_exposure(host: str, authenticated: bool, ucx: bool, insecure: bool) -> None:
    """Exit with the reasons if serving would expose the store, unless ``insecure``: then log
    each reason as a warning and go on."""
    problems = exposure_problems(host, authenticated, ucx)
    if not problems:
        if not authenticated:
            logger.warning(
                "authentication is off: any user of this host can read and write every page "
                "(set $%s on a shared machine)",
                TOKEN_ENV,
            )
        return
    if not insecure:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise SystemExit(
            f"kv store refuses to start:\n{lines}\n(--insecure starts it anyway; see --help)"
        )
    for problem in problems:
        logger.warning("INSECURE (--insecure): %s", problem)


def _build_store(args: argparse.Namespace, config: ServerConfig) -> PageStore:
    """The store; with tenant tokens, a store of its own for each tenant (its quota)."""
    from banaserve.kvstore.storage.tiered import TieredStore

    keep_freed_memory()  # this process holds the pages, whichever listener serves them

    if args.ssd_dir is not None and args.ssd_capacity_gb <= 0:
        raise SystemExit("--ssd-dir needs --ssd-capacity-gb > 0")
    capacity, ssd_capacity = int(args.capacity_gb * GiB), int(args.ssd_capacity_gb * GiB)
    ssd_dir = Path(args.ssd_dir) if args.ssd_dir is not None else None

    def make(ram: int, folder: Path | None, ssd: int) -> PageStore:
        return TieredStore(ram, ssd_dir=folder, ssd_capacity_bytes=ssd if folder else 0)

    if not config.tenant_tokens:
        return make(capacity, ssd_dir, ssd_capacity)
    quota = None if args.tenant_quota_gb is None else int(args.tenant_quota_gb * GiB)
    try:
        return build_tenant_stores(make, capacity, ssd_dir, ssd_capacity,
                                   config.tenant_tokens, bool(config.token), quota)  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"--tenant-quota-gb: {exc}") from None


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server's configuration; SystemExit for values that cannot work."""
    if args.capacity_gb <= 0:
        raise SystemExit("--capacity-gb must be positive")
    if args.max_connections <= 0:
        raise SystemExit("--max-connections must be positive")
    if args.inflight_fraction <= 0:
        raise SystemExit("--inflight-fraction must be positive")
    try:
        tenant_tokens = load_tenant_tokens(args.tenant_tokens) if args.tenant_tokens else {}
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--tenant-tokens: {exc}") from None
    capacity = int(args.capacity_gb * GiB)
    inflight = inflight_budget(capacity, args.inflight_fraction)
    info: dict[str, Any] = {
        "capacity_bytes": capacity,
        "ssd_dir": args.ssd_dir,
        "ssd_capacity_bytes": int(args.ssd_capacity_gb * GiB),
        "auth": bool(args.token or tenant_tokens),
        "tenants": len(tenant_tokens),
        "insecure": args.insecure,
    }
    return ServerConfig(
        host=args.host,
        port=args.port,
        token=args.token or None,
        tenant_tokens=tenant_tokens,
        limits=Limits(max_payload=args.max_payload_mb << 20),
        store_inline=args.ssd_dir is None,
        # Claims are memory a client can make the server hold too: no more than the budget.
        max_claims=max(1024, min(DEFAULT_MAX_CLAIMS, inflight // CLAIM_BYTES)),
        max_connections=args.max_connections,
        inflight_bytes=inflight,
        info=info,
    )


def _auth_words(config: ServerConfig) -> str:
    parts = ["shared token"] if config.token else []
    if config.tenant_tokens:
        parts.append(f"{len(config.tenant_tokens)} tenant tokens")
    return f"auth on ({', '.join(parts)})" if parts else "auth OFF"


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT, then close connections and flush the store."""
    config = config_from_args(args)
    authenticated = bool(config.token or config.tenant_tokens)
    check_exposure(args.host, authenticated, args.ucx_port is not None, args.insecure)
    store = _build_store(args, config)
    server = KvStoreServer(store, config)
    ucx = None
    try:
        try:
            await server.start()
        except OSError as exc:
            raise SystemExit(f"kv store cannot listen on {args.host}:{args.port}: {exc}") from None
        if args.ucx_port is not None:
            from banaserve.kvstore.server.ucx import start_ucx_listener

            assert server.address is not None
            ucx_port = args.ucx_port or server.address.port + 1
            # Blocks until listening (the first UCX context takes ~0.5 s): keep it off the loop.
            ucx = await asyncio.to_thread(
                start_ucx_listener,
                store,
                config,
                args.host,
                ucx_port,
                on_stored=server.notify_stored,
                # One budget for the process; a cap of its own (see server.ucx's docstring).
                admission=dataclasses.replace(
                    server.admission, gate=ConnectionGate(config.max_connections)
                ),
            )
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ssd = f"SSD {args.ssd_capacity_gb:g} GiB in {args.ssd_dir}" if args.ssd_dir else "no SSD"
        budget = server.admission.budget
        print(
            f"banaserve kv store listening on {server.url} (shm:// too from this host"
            f"{'; ' + ucx.url if ucx is not None else ''}); "
            f"pid {os.getpid()}, RAM {args.capacity_gb:g} GiB, {ssd}, {_auth_words(config)}, "
            f"at most {config.max_connections} connections and {budget.total >> 20} MiB "
            "in flight",
            flush=True,
        )
        await stop.wait()
        logger.info("stopping: closing connections and flushing the store")
    finally:
        if ucx is not None:
            await asyncio.to_thread(ucx.close)  # stops its thread, closes its connections
        await server.close()
        store.close()
    print(f"banaserve kv store on {server.url} stopped", flush=True)


def _log_to_stderr(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _log_to_stderr(args.log_level)
    asyncio.run(serve(args))


def ucx_main(argv: list[str] | None = None) -> None:
    """``python -m banaserve.kvstore.ucx_server``: a RAM store over ucx:// only (tests,
    benchmarks), with the tokens and bounds of the full server, until SIGTERM or SIGINT.
    Prints the URL when ready."""
    from banaserve.kvstore.server.ucx import start_ucx_listener

    parser = argparse.ArgumentParser(
        prog="python -m banaserve.kvstore.ucx_server",
        description="A BanaServe KV store over ucx:// only. See python -m "
        "banaserve.kvstore.server --help for the security model; tokens come from "
        f"${TOKEN_ENV} and ${TENANT_TOKENS_ENV}.",
    )
    parser.add_argument("--port", type=int, required=True, help="UCX port; 0 picks a free one")
    parser.add_argument(
        "--host",
        default=ServerConfig.host,
        help="host named in the URL; UCX listens on every interface, so anything but 0.0.0.0 "
        "needs --insecure (default: %(default)s)",
    )
    parser.add_argument("--capacity-gb", type=float, required=True, help="RAM tier capacity")
    parser.add_argument("--insecure", action="store_true", help="as for the full server")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    _log_to_stderr(args.log_level)
    full = build_parser().parse_args(
        ["--port", "0", "--host", args.host, "--capacity-gb", str(args.capacity_gb)]
    )
    full.insecure = args.insecure
    config = config_from_args(full)
    check_exposure(args.host, bool(config.token or config.tenant_tokens), True, args.insecure)
    store = _build_store(full, config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    handle = start_ucx_listener(store, config, args.host, args.port)
    print(f"banaserve kv store listening on {handle.url} pid {os.getpid()}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        handle.close()
        store.close()
