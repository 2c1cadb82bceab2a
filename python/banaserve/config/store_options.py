"""The KV store's options, in one place: their command-line flags are generated from the
fields of :class:`KvStoreOptions`, a cluster hands them to its instances as flags
(:meth:`KvStoreOptions.instance_flags`), and an instance hands them to SGLang's adapters as
extra config (:meth:`KvStoreOptions.to_extra`), which the adapters read back
(:meth:`KvStoreOptions.from_extra`). Each default is its field's default.

Light on purpose: SGLang's scheduler processes import it through the adapters.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: How long the HiCache backend waits for pages another request is computing: long enough to
#: cover a prefill under load. The backend waits on SGLang's prefetch thread, so only requests
#: still prefetching wait; the linker looks up on the scheduler thread and bounds its wait far
#: shorter (its ``lookup_wait_s``).
DEFAULT_COALESCE_WAIT_S = 30.0
KV_STORE_MODES = ("hicache", "linker")
#: ``--kv-store`` values that are not shard URLs: start one shard here / attach no store.
KV_STORE_EMBEDDED = "embedded"
KV_STORE_NONE = "none"
KV_STORE_FLAG = "--kv-store"
#: How long the linker's ``lookup`` waits for pages another instance is computing or storing.
#: It runs on the scheduler thread, so the bound is short: long enough for a prefill instance's
#: offload to land before the decode instance it handed off to looks the pages up
#: (milliseconds here).
DEFAULT_LOOKUP_WAIT_S = 1.0
#: The linker's host staging slots per load batch: its reader runs at most this many layers
#: ahead of the copies to the device.
DEFAULT_LOAD_DEPTH = 3
#: Host memory the linker's captures of freshly computed layers may hold per instance; a larger
#: forward is not captured (0 turns capturing off).
DEFAULT_LAYER_STORE_BYTES = 256 << 20


def _option(default: Any, help: str, *, to_instance: bool, to_extra: bool,
            choices: Sequence[str] | None = None) -> Any:  # fmt: skip
    """A field with a ``--kv-store-<name>`` flag. ``to_instance``: a cluster passes it to its
    instances' command lines; ``to_extra``: it reaches SGLang's adapters."""
    meta = {"help": help, "to_instance": to_instance, "to_extra": to_extra, "choices": choices}
    return field(default=default, metadata=meta)


def _tuning(default: Any) -> Any:
    """A field with no flag that reaches SGLang's adapters (a test or a config sets it)."""
    return field(default=default, metadata={"to_instance": False, "to_extra": True})


def _parse_as(f: dataclasses.Field) -> type | None:
    """The number type a flag's text (or a JSON value) is converted to; None: kept as is."""
    return {"int": int, "float": float}.get(str(f.type).split()[0])


@dataclass(frozen=True)
class KvStoreOptions:
    """``--kv-store*`` flags: shard URLs, or ``embedded`` (start one shard here); None for
    no store (no ``--kv-store``, or ``--kv-store none``)."""

    urls: list[str]
    embedded: bool = False
    token: str | None = _option(
        None,
        "Shared token of the store (default: $BANASERVE_KV_STORE_TOKEN; with 'embedded', a "
        "random one).",
        # Never on a command line (it would show in ``ps``): through the environment.
        to_instance=False, to_extra=False,
    )  # fmt: skip
    replication: int = _option(
        1, "Copies of each page across shards (default: 1).", to_instance=True, to_extra=True
    )
    capacity_gb: float = _option(
        2.0, "RAM of the embedded store shard in GiB (default: 2).",
        to_instance=False, to_extra=False,
    )  # fmt: skip
    tenant: str = _option(
        "",
        "Tenant name: instances of different tenants never share pages. A namespace the client "
        "picks, not a permission: a store with per-tenant tokens (--tenant-tokens) enforces "
        "tenants itself, from the token.",
        to_instance=True, to_extra=True,
    )  # fmt: skip
    mode: str = _option(
        "hicache",
        "How SGLang reaches the store: 'hicache' (the default: HiCache L3 storage behind a host "
        "KV pool) or 'linker' (SGLang's external linker: prefix KV is loaded from the store "
        "straight into the device pool, layer by layer through BanaServe's pipeline, the "
        "forward waiting per layer, and new pages leave the device layer by layer during the "
        "forward; MHA models only).",
        to_instance=True, to_extra=True, choices=KV_STORE_MODES,
    )  # fmt: skip
    coalesce_wait_s: float = _option(
        DEFAULT_COALESCE_WAIT_S,
        "When a prompt's pages are being computed by another request (on any instance), wait "
        "up to this long for them to reach the store instead of computing them again, "
        "unless they would make a hit shorter than SGLang's prefetch threshold "
        f"(default: {DEFAULT_COALESCE_WAIT_S:g}; 0 turns coalescing off).",
        to_instance=True, to_extra=True,
    )  # fmt: skip
    lookup_wait_s: float = _tuning(DEFAULT_LOOKUP_WAIT_S)
    load_depth: int = _tuning(DEFAULT_LOAD_DEPTH)
    layer_store_bytes: int = _tuning(DEFAULT_LAYER_STORE_BYTES)

    @staticmethod
    def flag(name: str) -> str:
        return f"{KV_STORE_FLAG}-{name.replace('_', '-')}"

    @classmethod
    def flagged_fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if "help" in f.metadata]

    @classmethod
    def extra_fields(cls) -> list[dataclasses.Field]:
        """The fields that reach SGLang's adapters (:meth:`to_extra`)."""
        return [f for f in dataclasses.fields(cls) if f.metadata.get("to_extra")]

    @classmethod
    def add_args(cls, group: argparse._ArgumentGroup) -> None:
        """``--kv-store`` and one flag per option field, with the field's default."""
        group.add_argument(
            KV_STORE_FLAG,
            metavar=f"URL[,URL...]|{KV_STORE_EMBEDDED}|{KV_STORE_NONE}",
            default=None,
            help="Attach this server to the Global KV Cache Store: a comma-separated list of "
            f"shard URLs (tcp://, shm://, ucx://), or '{KV_STORE_EMBEDDED}' to start one shard "
            f"for this server. A cluster starts its own shard by default; '{KV_STORE_NONE}' "
            "runs it without any store (no KV handoff: every request runs whole on the least "
            "loaded instance).",
        )
        for f in cls.flagged_fields():
            kind = _parse_as(f)
            group.add_argument(
                cls.flag(f.name), default=f.default, help=f.metadata["help"],
                choices=f.metadata["choices"], **({"type": kind} if kind else {}),
            )  # fmt: skip

    @classmethod
    def value_flags(cls) -> tuple[str, ...]:
        """Every flag of these options that takes a value."""
        return (KV_STORE_FLAG, *(cls.flag(f.name) for f in cls.flagged_fields()))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KvStoreOptions | None:
        """The options of parsed flags (ValueError when out of range); None for no store."""
        if not args.kv_store or kv_store_is_none(args):
            return None
        embedded = args.kv_store.strip() == KV_STORE_EMBEDDED
        urls = [] if embedded else [u.strip() for u in args.kv_store.split(",") if u.strip()]
        values = {f.name: getattr(args, "kv_store_" + f.name) for f in cls.flagged_fields()}
        return cls(urls, embedded, **values).checked()

    def checked(self) -> KvStoreOptions:
        for url in self.urls:
            if "://" not in url:
                raise ValueError(f"--kv-store: {url!r} is not a URL like tcp://host:port")
        if self.coalesce_wait_s < 0:
            raise ValueError("--kv-store-coalesce-wait-s must not be negative")
        if self.replication < 1:
            raise ValueError("--kv-store-replication must be at least 1")
        if not self.embedded and self.replication > len(self.urls):
            raise ValueError(
                f"--kv-store-replication {self.replication} needs at least as many shards, "
                f"got {len(self.urls)}"
            )
        return self

    def instance_flags(self, urls: Sequence[str]) -> list[str]:
        """The flags that attach one instance of a cluster to the store at ``urls``, which
        :meth:`from_args` reads back into these options (with those urls, not embedded). No
        token: it travels in the instance's environment, never its argv."""
        out = [KV_STORE_FLAG, ",".join(urls)]
        for f in self.flagged_fields():
            if f.metadata["to_instance"]:
                value = getattr(self, f.name)
                out += [self.flag(f.name), repr(value) if isinstance(value, float) else str(value)]
        return out

    def to_extra(self, urls: Sequence[str]) -> dict[str, Any]:
        """What SGLang's adapters need of these options, as JSON-able extra config, with the
        store at ``urls``; :meth:`from_extra` reads it back."""
        extra: dict[str, Any] = {"urls": list(urls)}
        for f in self.extra_fields():
            extra[f.name] = getattr(self, f.name)
        return extra

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> KvStoreOptions:
        """The options an adapter's extra config carries (missing keys: the defaults); a
        ``token`` there is honoured, though :meth:`to_extra` never writes one."""
        values = {
            f.name: (_parse_as(f) or str)(extra[f.name])
            for f in cls.extra_fields()
            if f.name in extra
        }
        urls = [str(u) for u in extra.get("urls") or []]
        return cls(urls, token=extra.get("token"), **values)


def kv_store_is_none(args: argparse.Namespace) -> bool:
    """``--kv-store none``: no store at all, not even a cluster's embedded one."""
    return (args.kv_store or "").strip() == KV_STORE_NONE
