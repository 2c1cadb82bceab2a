"""Who may call the gateway: ``--api-key`` for serving, the admin token for admin calls.

``--api-key``: the gateway asks clients for the key as SGLang's server does, and sends it on
every call it makes to an instance (each instance is started with the same key). SGLang 0.5.23
(``sglang/srt/utils/auth.py``) answers 401 unless ``Authorization`` is ``Bearer <key>``, except
for OPTIONS requests and paths under ``/health`` and ``/metrics``; the gateway does the same,
so a client sees one behaviour whether it talks to one server or to a cluster.

The admin token: the gateway's admin calls (:data:`ADMIN_ROUTES`: flushing and clearing
caches, moving instances) need ``Bearer <admin token>``, whether or not there is an API key, as
SGLang's own admin routes need its ``--admin-api-key``. The token is ``--admin-api-key`` when
given, else ``$BANASERVE_ADMIN_TOKEN``, else one the launcher makes and writes to a file only
its user can read (:func:`admin_token_for`). The instances get it as their ``--admin-api-key``
(through the environment, never argv, which other users can read), so their own admin routes
refuse anyone else too. The admin token works on every route; a request that carries it also
sees what ``/cluster`` keeps from others (process ids, paths, arguments).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from banaserve.env import ADMIN_TOKEN_ENV

logger = logging.getLogger("banaserve.cluster")

#: Paths served without any credential (SGLang's exemptions): probes and scrapers carry none.
OPEN_PREFIXES = ("/health", "/metrics")
#: The gateway's routes that change the cluster's state.
ADMIN_ROUTES = frozenset({
    ("POST", "/flush_cache"), ("GET", "/flush_cache"), ("POST", "/clear_caches"),
    ("POST", "/migration"),
})  # fmt: skip
#: Where a request's handler finds whether it carried the admin token.
IS_ADMIN = "banaserve_admin"
#: The file, in the cluster's log folder, that holds a token the launcher made.
ADMIN_TOKEN_FILE = "admin-token"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def bearer(token: str | None) -> dict[str, str]:
    """The header that carries ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def _carries(request: web.Request, token: str | None) -> bool:
    if not token:
        return False
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {token}".encode())


def authorize(api_key: str | None, admin_token: str) -> Middleware:
    """An aiohttp middleware: admin routes need ``admin_token``; every other route but the
    open ones needs ``api_key`` (or ``admin_token``) when there is an API key."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        admin = _carries(request, admin_token)
        request[IS_ADMIN] = admin
        if request.method == "OPTIONS":
            return await handler(request)
        if (request.method, request.path) in ADMIN_ROUTES:
            if not admin:
                message = ("Unauthorized: an admin call needs the admin token "
                           f"(--admin-api-key or ${ADMIN_TOKEN_ENV}).")  # fmt: skip
                return web.json_response({"error": message}, status=401)
        elif api_key and not request.path.startswith(OPEN_PREFIXES):
            if not (admin or _carries(request, api_key)):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def admin_token_for(given: str | None, log_dir: Path) -> str:
    """The cluster's admin token: ``given`` (``--admin-api-key``), else ``$BANASERVE_ADMIN_
    TOKEN``, else a new random one, written to ``log_dir/admin-token`` (an earlier run's file
    replaced, the new one created exclusively with mode 0600) and its path logged."""
    token = given or os.environ.get(ADMIN_TOKEN_ENV)
    if token:
        return token
    token = secrets.token_urlsafe(24)
    path = log_dir / ADMIN_TOKEN_FILE
    path.unlink(missing_ok=True)  # an earlier run's; a file planted meanwhile fails the open
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(token + "\n")
    logger.info("admin token (for /clear_caches, /flush_cache, POST /migration) in %s", path)
    return token


#: What ``/cluster`` shows only to a request carrying the admin token: how the processes run.
PRIVATE_STATE = ("pids", "log_dir")


def cluster_state_shown(state: dict[str, Any], admin: bool) -> dict[str, Any]:
    """``/cluster``'s ``state`` as the requester may see it: without :data:`PRIVATE_STATE` and
    the instances' arguments unless ``admin``."""
    if admin:
        return state
    shown = {k: v for k, v in state.items() if k not in PRIVATE_STATE}
    shown["instances"] = [{k: v for k, v in i.items() if k != "args"} for i in state["instances"]]
    return shown


#: SGLang's ``/server_info`` (and ``/get_server_info``) answer is every server argument, the
#: keys included, and the command line: the gateway passes it on with the keys redacted, and
#: without the command line (paths, arguments) unless the request carries the admin token.
SERVER_INFO_PATHS = frozenset({"/get_server_info", "/server_info"})
SECRET_ARGS = ("api_key", "admin_api_key")
REDACTED = "<redacted>"


def redacted_server_info(
    info: dict[str, Any], admin: bool, secrets_known: tuple[str | None, ...] = ()
) -> dict[str, Any]:
    """``info`` with :data:`SECRET_ARGS` redacted at any depth, and every occurrence of a
    string of ``secrets_known`` (the gateway's keys: they also show in per-rank states and
    argv-like fields); ``launch_command`` dropped for others than the admin."""
    known = [secret for secret in secrets_known if secret]

    def scrub(value: Any, name: str = "") -> Any:
        if name in SECRET_ARGS and value is not None:
            return REDACTED
        if isinstance(value, dict):
            return {k: scrub(v, str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [scrub(v) for v in value]
        if isinstance(value, str):
            for secret in known:
                value = value.replace(secret, REDACTED)
        return value

    out = scrub(info)
    command = out.pop("launch_command", None)
    if admin and command is not None:
        out["launch_command"] = _redacted_command(command)
    return out


def _redacted_command(command: Any) -> Any:
    flags = {f"--{name.replace('_', '-')}" for name in SECRET_ARGS}
    words = command.split() if isinstance(command, str) else command
    if not isinstance(words, list):
        return REDACTED
    shown = []
    for i, word in enumerate(words):
        name, equals, _ = str(word).partition("=")
        if name in flags and equals:
            shown.append(f"{name}={REDACTED}")
        elif i > 0 and str(words[i - 1]) in flags:
            shown.append(REDACTED)
        else:
            shown.append(word)
    return " ".join(shown) if isinstance(command, str) else shown
