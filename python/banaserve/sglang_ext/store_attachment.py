"""What SGLang's two ways into the store (the HiCache backend and the external linker) share:
the client built from their extra config, and the key namespace of one instance's pages.

Both must agree on the namespace, or an instance in one mode would not find the pages an
instance in the other mode stored.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from banaserve.kvstore import TOKEN_ENV
from banaserve.kvstore.keys import KvLayout, Namespace

if TYPE_CHECKING:
    from banaserve.kvstore.client import KvStoreClient

#: How long a claim on missing pages holds without their PUT, in both adapters: past it, an
#: instance waiting for the pages computes them itself. Longer than a prefill takes here under
#: load (a long prompt on a busy CPU instance takes tens of seconds), so a slow prefill is not
#: computed twice; a lost claim costs nothing more, since an aborted request releases its
#: claims and a dead process's claims end with its connection.
CLAIM_LEASE_S = 60.0
#: How long the HiCache backend waits for pages another request is computing (the CLI's
#: ``--kv-store-coalesce-wait-s`` default, and the backend's when its extra config says
#: nothing): long enough to cover a prefill under load. The backend waits on SGLang's
#: prefetch thread, so only requests still prefetching wait; the linker looks up on the
#: scheduler thread and bounds its wait far shorter (its ``lookup_wait_s``).
DEFAULT_COALESCE_WAIT_S = 30.0


def open_client(extra: dict[str, Any], who: str) -> KvStoreClient:
    """A client for the shard ``urls`` of ``extra``; the token from ``extra`` or
    ``$BANASERVE_KV_STORE_TOKEN``. ``who`` names the caller in the error for missing urls."""
    from banaserve.kvstore.client import KvStoreClient

    urls = extra.get("urls")
    if not urls:
        raise ValueError(f"{who} needs 'urls' in its extra config")
    return KvStoreClient(
        urls,
        token=extra.get("token") or os.environ.get(TOKEN_ENV),
        replication=int(extra.get("replication", 1)),
    )


def instance_namespace(
    model_name: str | None,
    tp: tuple[int, int],
    pp: tuple[int, int],
    layout: KvLayout,
    tenant: str,
) -> bytes:
    """The namespace digest of one (tensor, pipeline)-parallel rank's pages: each rank holds
    its own shard of the heads (tp) and layers (pp), so ranks never share keys."""
    model = f"{model_name or ''}|tp{tp[0]}/{tp[1]}|pp{pp[0]}/{pp[1]}"
    return Namespace(model, layout, tenant).digest()
