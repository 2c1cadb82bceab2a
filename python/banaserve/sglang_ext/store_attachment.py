"""What SGLang's two ways into the store (the HiCache backend and the external linker) share:
one :class:`StoreAttachment` per instance rank, holding the client built from their extra
config, the key namespace of that rank's pages, its claim owner, its claim ledger and its KV
layout.

Both must agree on the namespace, or an instance in one mode would not find the pages an
instance in the other mode stored.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from banaserve.env import TOKEN_ENV
from banaserve.kvstore.keys import KvLayout, Namespace, namespaced_key
from banaserve.sglang_ext import abort_release
from banaserve.sglang_ext.store_metrics import StoreMetrics, store_metrics

if TYPE_CHECKING:
    from banaserve.config.store_options import KvStoreOptions
    from banaserve.kvstore.client import KvStoreClient

#: How long a claim on missing pages holds without their PUT, in both adapters: past it, an
#: instance waiting for the pages computes them itself. Longer than a prefill takes here under
#: load (a long prompt on a busy CPU instance takes tens of seconds), so a slow prefill is not
#: computed twice; a lost claim costs nothing more, since an aborted request releases its
#: claims and a dead process's claims end with its connection.
CLAIM_LEASE_S = 60.0


def open_client(options: KvStoreOptions, who: str) -> KvStoreClient:
    """A client for the shards of ``options`` (read from an adapter's extra config); the token
    from there or ``$BANASERVE_KV_STORE_TOKEN``. ``who`` names the caller in the error for
    missing urls."""
    from banaserve.kvstore.client import KvStoreClient

    if not options.urls:
        raise ValueError(f"{who} needs 'urls' in its extra config")
    return KvStoreClient(
        options.urls,
        token=options.token or os.environ.get(TOKEN_ENV),
        replication=options.replication,
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


@dataclass(frozen=True)
class RankIdentity:
    """Which pages a rank owns: its model, its (tensor, pipeline)-parallel position and tenant."""

    model_name: str | None
    tp: tuple[int, int] = (0, 1)
    pp: tuple[int, int] = (0, 1)
    tenant: str = ""


@dataclass
class StoreAttachment:
    """One instance rank's attachment to the store.

    Owns ``client`` (closed by :meth:`close`) and ``ledger``, which is registered with
    :mod:`~banaserve.sglang_ext.abort_release` so that an aborted request's claims are ended.
    ``namespace`` (derived from ``rank`` and ``layout``) never changes. Claims are held by
    ``owner``, or with ``per_request_owner`` by ``owner/<request id>``: the HiCache backend
    looks up on a prefetch thread, where a request may wait for another request's pages of the
    same instance; the linker looks up on the scheduler thread, which must never wait for pages
    only its own next batch computes, so it claims as the instance. Every store call made
    through it is counted in :mod:`~banaserve.sglang_ext.store_metrics`. Thread-safe as the
    client and the ledger are; every call blocks for a store round trip, and
    :meth:`claiming_lookup` up to its ``wait_s`` more. Buffers are the caller's, used only
    during the call.
    """

    client: KvStoreClient
    rank: RankIdentity
    layout: KvLayout
    owner: str
    per_request_owner: bool = False
    claims: bool = True
    namespace: bytes = field(init=False)
    ledger: abort_release.ClaimLedger | None = field(init=False, default=None)
    metrics: StoreMetrics = field(init=False, default_factory=store_metrics)

    def __post_init__(self) -> None:
        rank = self.rank
        self.namespace = instance_namespace(
            rank.model_name, rank.tp, rank.pp, self.layout, rank.tenant
        )
        if self.claims:
            self.ledger = abort_release.ClaimLedger(self._release, CLAIM_LEASE_S)
            abort_release.register(self.ledger)

    def keys(self, keys: Sequence[str]) -> list[bytes]:
        """The store keys of SGLang's page hashes ``keys``."""
        return [namespaced_key(self.namespace, key) for key in keys]

    def owner_of(self, request_id: str) -> str:
        return f"{self.owner}/{request_id}" if self.per_request_owner else self.owner

    def claiming_lookup(
        self, request_id: str, keys: list[bytes], wait_s: float, min_wait_keys: int = 0
    ) -> int:
        """Leading ``keys`` stored, after waiting up to ``wait_s`` for those another owner is
        computing (only if they would make the hit ``min_wait_keys`` long); the missing tail is
        claimed for ``request_id`` until its pages are stored, or released if it is aborted
        first. Needs ``claims``."""
        if self.ledger is None:
            raise RuntimeError("this store attachment was opened without claims")
        owner = self.owner_of(request_id)
        with self.metrics.timed("lookup"):
            hit = self.client.lookup(
                keys, owner=owner, wait_s=wait_s, lease_s=CLAIM_LEASE_S, min_wait_keys=min_wait_keys
            )
        self.ledger.record(request_id, keys[hit:])
        return hit

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` stored, claiming and waiting for nothing."""
        with self.metrics.timed("lookup"):
            return self.client.longest_prefix(keys)

    def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        """Read page ``keys[i]`` into ``buffers[i]`` (one buffer or a list of segments)."""
        with self.metrics.timed("get"):
            found = self.client.get(keys, buffers)
        self.metrics.moved("get", _found_bytes(buffers, found))
        return found

    def get_layers(self, keys: Sequence[bytes], first: int, last: int,
                   out: Sequence[Any]) -> list[bool]:  # fmt: skip
        """Read layers ``[first, last)`` of page ``keys[i]`` into ``out[i]``."""
        with self.metrics.timed("get"):
            found = self.client.get_layers(keys, self.layout, first, last, out)
        self.metrics.moved("get", sum(found) * (last - first) * self.layout.layer_bytes)
        return found

    def put(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        """Write page ``keys[i]`` from ``buffers[i]`` (one buffer or a list of segments)."""
        with self.metrics.timed("put"):
            stored = self.client.put(keys, buffers)
        self.metrics.moved("put", _found_bytes(buffers, stored))
        return stored

    def _release(self, request_id: str, keys: list[bytes]) -> None:
        self.client.release(keys, self.owner_of(request_id))

    def close(self) -> None:
        self.client.close()


def _found_bytes(buffers: Sequence[Any], ok: Sequence[bool]) -> int:
    return sum(_nbytes(b) for b, hit in zip(buffers, ok, strict=True) if hit)


def _nbytes(buffer: Any) -> int:
    if isinstance(buffer, list | tuple):
        return sum(_nbytes(part) for part in buffer)
    return int(getattr(buffer, "nbytes", None) or len(buffer))
