"""One way for both launchers (a single server and a cluster) to reach the KV store: start the
embedded shard when asked, and settle the URLs and the token the instances attach with."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from banaserve.config.store_options import KvStoreOptions
from banaserve.env import TOKEN_ENV
from banaserve.utils.processes import ManagedProcess


@dataclass(frozen=True)
class StartedStore:
    """The store a launcher's instances attach to.

    ``process`` is the embedded shard this launcher started: the launcher owns it and stops
    it (by PID, through :class:`ManagedProcess`); None for shards someone else runs. ``token``
    reaches the instances through their environment, never their argv.
    """

    urls: list[str]
    token: str | None
    process: ManagedProcess | None = None


def start_store(options: KvStoreOptions, log_dir: Path | None = None) -> StartedStore:
    """The shards of ``options``, or the embedded one started now (its log in ``log_dir``, by
    default a new temporary folder). Token: ``--kv-store-token``, else
    ``$BANASERVE_KV_STORE_TOKEN``, else (embedded only) a random one. Blocks until the
    embedded shard listens; raises ``ChildFailed`` if it dies first."""
    from banaserve.kvstore.embedded import start_embedded_store

    token = options.token or os.environ.get(TOKEN_ENV)
    if not options.embedded:
        return StartedStore(list(options.urls), token)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="banaserve-kvstore-"))
    process, url, token = start_embedded_store(options.capacity_gb, token, log_dir)
    return StartedStore([url], token, process)
