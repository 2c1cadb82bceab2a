"""The KV store client: pages by key over a sharded, replicated set of store servers.

:mod:`.store_client` is the client (:class:`KvStoreClient`, its failure model);
:mod:`.shard` one server as the client sees it (a pool of connections, up/down with
backoff); :mod:`.replicas` which shard each key goes to; :mod:`.buffers` the caller's keys
and buffers as byte views, and how a batch becomes frames.
"""

from __future__ import annotations

from banaserve.kvstore.client.buffers import byte_view
from banaserve.kvstore.client.store_client import KvStoreClient
from banaserve.kvstore.transport import KvStoreAuthError, KvStoreError, KvStoreRemoteError

__all__ = [
    "KvStoreAuthError",
    "KvStoreClient",
    "KvStoreError",
    "KvStoreRemoteError",
    "byte_view",
]
