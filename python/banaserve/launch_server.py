"""``python -m banaserve.launch_server [SGLang server flags] [BanaServe flags]``.

With one instance this is an SGLang server with BanaServe's CPU platform and defaults that
fit the machine: on a host with no NVIDIA driver it adds ``--device cpu``, ``--sleep-on-idle``,
``--dtype float32`` (for "auto") and a KV pool sized from free memory; everywhere it enables
``/metrics``, serves SmolLM2-135M-Instruct when no model is given, and checks every generation
request before SGLang sees it (``banaserve.server.request_guard``: 4xx for bodies out of
bounds, token ids out of the vocabulary, a model it does not serve).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

from banaserve.api.host_names import allowed_host_names
from banaserve.api.request_limits import RequestLimits
from banaserve.config.cli import (
    ClusterOptions,
    EngineFlags,
    LaunchConfig,
    build_parser,
    cpu_dtype,
    request_limits_from_args,
    sglang_flags_of,
)
from banaserve.config.pipeline_options import (
    check_boundary_flags,
    layer_split,
    lending_split,
    movable_env,
    pipeline_env,
)
from banaserve.config.store_options import KV_STORE_EMBEDDED, KvStoreOptions
from banaserve.env import ADMIN_TOKEN_ENV, ATTENTION_OFFLOAD_ENV, MOVABLE_ENV, REQUEST_WAIT_ENV
from banaserve.migration.boundary_control import split_dir_for
from banaserve.platform import cpu_platform_wanted, install
from banaserve.router.loads_report import PUBLISH_EVERY_DECODE_STEPS
from banaserve.server.kv_pool_sizing import size_kv_pool
from banaserve.server.memory_plan import host_pool_ratio
from banaserve.server.rendezvous import PrivateRendezvous, needs_private_rendezvous
from banaserve.utils.processes import ManagedProcess

# The .pth file normally installed the hook already; this covers running from a source tree,
# and SGLang's spawned children, which import this module as their __mp_main__. No sglang
# import happens above this line.
install()

logger = logging.getLogger("banaserve.launch_server")

KV_STORE_PAGE_SIZE = 16


#: A request still waiting in an instance's queue whose client has left is aborted within this
#: many seconds (SGLang's default, 4, would let it take a batch slot meanwhile); a running one
#: is aborted at its next step whatever this says.
CLIENT_GONE_CHECK_S = 1


def plan_launch(argv: list[str]) -> LaunchConfig:
    """Validate ``argv`` and decide the SGLang argv; may convert the default model (slow)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with usage text on a bad flag
    notes: list[str] = []
    try:
        sglang_argv = sglang_flags_of(argv, parser)
        cluster = ClusterOptions.from_args(args)
        if cluster is not None and args.kv_store is None:
            args.kv_store = KV_STORE_EMBEDDED  # its own store, unless told --kv-store none
        kv_store = KvStoreOptions.from_args(args)
        request_limits = request_limits_from_args(args)
        # --migration layer makes the decode instances two-stage itself (lending_split below).
        lends_layers = cluster is not None and cluster.migration == "layer"
        if not lends_layers:
            check_boundary_flags(args.pp_layer_boundary, args.pp_size)  # before any conversion
    except ValueError as exc:
        parser.error(str(exc))
    if kv_store is not None:
        if args.page_size is None:
            # One store key per token would cost a hash and a round trip per token.
            sglang_argv += ["--page-size", str(KV_STORE_PAGE_SIZE)]
        prefetch_set = any(a.startswith("--hicache-storage-prefetch-policy") for a in argv)
        if kv_store.mode == "hicache" and not prefetch_set:
            # The store makes a prefix computed anywhere loadable here: wait for it rather
            # than compute it again (a down shard answers at once, as a miss).
            sglang_argv += ["--hicache-storage-prefetch-policy", "wait_complete"]

    model_path = args.model_path
    if model_path is None:
        from banaserve.models import default_model_path

        model_path = str(default_model_path())
        sglang_argv += ["--model-path", model_path]
        notes.append(f"no --model-path: serving {model_path}")
    served_name = args.served_model_name
    if served_name is None:
        served_name = Path(model_path.rstrip("/")).name or model_path
        sglang_argv += ["--served-model-name", served_name]
    if not args.enable_metrics:
        sglang_argv.append("--enable-metrics")
    if not args.enable_cache_report:
        # OpenAI replies then say how many prompt tokens were cached, as /generate's do: the
        # gateway books them per instance and for a conversation's next turns (/cluster).
        sglang_argv.append("--enable-cache-report")
    if not any(a.startswith("--load-snapshot-publish-interval") for a in argv):
        # The gateway routes on each instance's /v1/loads snapshot: keep it one step old.
        sglang_argv += ["--load-snapshot-publish-interval", str(PUBLISH_EVERY_DECODE_STEPS)]

    if cpu_platform_wanted() and not args.no_cpu_defaults:
        if args.device is None:
            sglang_argv += ["--device", "cpu"]
        if not args.sleep_on_idle:
            sglang_argv.append("--sleep-on-idle")
        dtype = cpu_dtype(args.dtype)
        if dtype != args.dtype:
            # A cluster's instances add it too (their argv is the user's), and its memory
            # plan sizes for it (cluster.run.memory_plan): every side agrees on the pools.
            sglang_argv += ["--dtype", dtype]
            notes.append(f"dtype {dtype} (the CPU default; --dtype to change)")
        config = Path(model_path, "config.json")
        # A cluster's instances size their own shares (see the cluster's memory plan).
        if cluster is None and args.max_total_tokens is None and config.is_file():
            uses_hicache = kv_store is not None and kv_store.mode == "hicache"
            ratio = host_pool_ratio(uses_hicache, args.hicache_ratio, args.hicache_size)
            size = size_kv_pool(
                Path(model_path), args.kv_pool_memory_fraction, dtype, host_ratio=ratio
            )
            sglang_argv += ["--max-total-tokens", str(size.tokens)]
            notes.append(
                f"KV pool {size.tokens} tokens ({size.tokens * size.bytes_per_token / 2**30:.2f}"
                f" GiB of {size.available_bytes / 2**30:.1f} GiB available)"
            )
        notes.append("no NVIDIA driver: SGLang CPU engine")
    try:
        if lends_layers:
            split = lending_split(args.pp_layer_boundary, args.pp_size, Path(model_path))
            lent = (
                f"layers [{split.boundary}, {split.num_layers})"
                if split.boundary < split.num_layers
                else "no layer until the controller finds it pays"
            )
            notes.append(f"decode instances start lending {lent}")
            env = {}
        else:
            env = pipeline_plan(args, Path(model_path), notes, serves=cluster is None)
    except ValueError as exc:
        parser.error(str(exc))
    if REQUEST_WAIT_ENV not in os.environ:
        env[REQUEST_WAIT_ENV] = str(CLIENT_GONE_CHECK_S)
    if args.attention_offload is not None:
        if cluster is not None:
            parser.error("--attention-offload applies to one instance, not a cluster (yet)")
        env[ATTENTION_OFFLOAD_ENV] = args.attention_offload.to_json()
        notes.append(f"attention offload: {env[ATTENTION_OFFLOAD_ENV]}")
    return LaunchConfig(
        sglang_argv=sglang_argv,
        served_names=[served_name, model_path],
        notes=notes,
        kv_store=kv_store,
        cluster=cluster,
        request_limits=request_limits,
        env=env,
        argv=list(argv),
        flags=EngineFlags.from_namespace(args),
        allowed_hosts=allowed_host_names(args.host, args.allowed_hosts.split(",")),
    )


def pipeline_plan(
    args: argparse.Namespace, model_path: Path, notes: list[str], *, serves: bool
) -> dict[str, str]:
    """The environment SGLang's pipeline stages need (see
    :mod:`banaserve.config.pipeline_options`), for this process's cores; ValueError when
    ``--pp-layer-boundary`` does not fit ``--pp-size`` or the model. ``serves``: this process
    runs the server; a cluster's launcher only checks, since each instance's own launcher
    decides its environment, from the cores it is pinned to."""
    split = layer_split(
        args.pp_layer_boundary, args.pp_size, model_path, movable=args.pp_min_boundary is not None
    )
    if not serves:
        return {}
    if split is not None:
        notes.append(
            f"pipeline: stage 0 runs layers [0, {split.boundary}), stage 1 "
            f"[{split.boundary}, {split.num_layers})"
        )
    ranks = args.dp_size * args.tp_size * args.pp_size
    cores = sorted(os.sched_getaffinity(0))
    env = pipeline_env(split, ranks, cores, os.environ, cpu=cpu_platform_wanted())
    env.update(movable_env(split, args.pp_min_boundary, split_dir_for(os.getpid())))
    if args.pp_min_boundary is not None:
        notes.append(f"the boundary moves between {args.pp_min_boundary} and {split.num_layers}"
                     " (GET and POST /pp_boundary)")  # fmt: skip
    notes.extend(f"{key}={value}" for key, value in env.items())
    return env


def attach_kv_store(options: KvStoreOptions) -> tuple[ManagedProcess | None, list[str]]:
    """Start the embedded shard if asked; return it and the SGLang flags that attach to the
    store. The token reaches SGLang's children through the environment, not the argv."""
    from banaserve.env import TOKEN_ENV
    from banaserve.server.store_start import start_store

    started = start_store(options)
    process, urls, token = started.process, started.urls, started.token
    if process is not None:
        logger.info("embedded KV store at %s (log: %s)", urls[0], process.log_path)
    if token:
        os.environ[TOKEN_ENV] = token
    logger.info(
        "KV store: %s, replication %d, through %s",
        ", ".join(urls), options.replication, options.mode,
    )  # fmt: skip
    if options.mode == "linker":
        from banaserve.sglang_ext.kvstore_linker import linker_args

        return process, linker_args(options, urls)
    from banaserve.sglang_ext.kvstore_backend import hicache_args

    return process, hicache_args(options, urls)


def add_request_checks(
    served_names: list[str], limits: RequestLimits, allowed_hosts: frozenset[str] | None = None
) -> None:
    """The request guard on SGLang's app, and the token-id check where SGLang tokenises.
    SGLang's CORS middleware (any origin, with credentials: a page on any site the user
    visits may read this server's answers) is taken out: no route here is meant for browsers
    of other origins."""
    from fastapi.middleware.cors import CORSMiddleware
    from sglang.srt.entrypoints.http_server import app

    from banaserve.server import token_id_check
    from banaserve.server.host_check import HostCheck
    from banaserve.server.request_guard import RequestGuard

    app.user_middleware = [m for m in app.user_middleware if m.cls is not CORSMiddleware]
    app.add_middleware(RequestGuard, served_names=served_names, limits=limits)
    app.add_middleware(HostCheck, allowed=allowed_hosts)  # added last: runs first
    token_id_check.install()


def run_cluster_or_exit(plan: LaunchConfig) -> None:
    from banaserve.cluster.run import run_cluster
    from banaserve.server.memory_plan import MemoryPlanError
    from banaserve.utils.processes import ChildFailed

    logging.getLogger("banaserve.cluster").handlers = logger.handlers
    logging.getLogger("banaserve.cluster").setLevel(logging.INFO)
    logging.getLogger("banaserve.cluster").propagate = False
    try:
        run_cluster(plan)
    except (ChildFailed, MemoryPlanError, ValueError) as exc:
        logger.error("the cluster failed to start: %s", exc)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[banaserve] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # SGLang configures the root logger with its own format
    argv = list(sys.argv[1:] if argv is None else argv)
    plan = plan_launch(argv)
    for note in plan.notes:
        logger.info(note)
    if plan.cluster is not None:
        run_cluster_or_exit(plan)
        return
    # Before SGLang starts: its scheduler processes inherit the environment.
    os.environ.update(plan.env)

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    store_process = None
    split_dir = None
    rendezvous = None
    try:
        sglang_argv = plan.sglang_argv
        if plan.kv_store is not None:
            store_process, store_args = attach_kv_store(plan.kv_store)
            sglang_argv = sglang_argv + store_args
        admin_token = os.environ.get(ADMIN_TOKEN_ENV)
        if admin_token and not any(a.startswith("--admin-api-key") for a in sglang_argv):
            # A cluster's instance: the launcher's admin token guards its admin routes too.
            sglang_argv = [*sglang_argv, "--admin-api-key", admin_token]
        server_args = prepare_server_args(sglang_argv)
        if needs_private_rendezvous(server_args.nnodes, server_args.dist_init_addr):
            rendezvous = PrivateRendezvous(server_args.port)
        add_request_checks(plan.served_names, plan.request_limits, plan.allowed_hosts)
        if MOVABLE_ENV in plan.env:
            from banaserve.server.boundary_route import add_boundary_route

            split_dir = add_boundary_route(plan.env)
        run_server(server_args)
    finally:
        if split_dir is not None:
            shutil.rmtree(split_dir, ignore_errors=True)
        if rendezvous is not None:
            rendezvous.remove()
        if store_process is not None:
            store_process.stop()
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
