"""``launch_server --num-prefill P --num-decode D``: store, instances and gateway, in order.

Start-up: the reaper (which cleans up if the launcher is killed), the embedded store (unless
``--kv-store`` names shards, or is ``none``: then the instances get no store and the gateway
hands nothing off), then every instance at once (progress every few seconds; one that exits
or is not ready in time fails the start with its last log lines), then the gateway on
``--host``/``--port``. Ctrl-C or SIGTERM stops the gateway and every child, and
removes the shared-memory files the children left. A child that dies later is reported with
its last log lines and restarted by :mod:`banaserve.cluster.supervisor`; the others keep
serving meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from banaserve.api.request_limits import ModelLimits
from banaserve.cluster.client_guard import CappedSite, gateway_runner
from banaserve.cluster.credentials import admin_token_for, bearer
from banaserve.cluster.gateway import Gateway
from banaserve.cluster.intake import Intake, load_tokenizer, model_vocab_size
from banaserve.cluster.layer_layout import LayerLayout
from banaserve.cluster.layer_loop import LayerLending, LayerMigration
from banaserve.cluster.leftovers import LeftoverLedger, clean_up
from banaserve.cluster.load_board import LoadBoard, poll_forever
from banaserve.cluster.processes import Child, ClusterProcesses, default_log_dir
from banaserve.cluster.reaper import Reaper
from banaserve.cluster.role_loop import RoleMigration
from banaserve.cluster.supervisor import Supervisor
from banaserve.cluster.topology import (
    DECODE,
    PREFILL,
    InstanceSpec,
    lend_decode_layers,
    plan_cores,
    plan_instances,
)
from banaserve.config.cli import (
    CLUSTER_GROUP,
    KV_STORE_VALUE_FLAGS,
    ClusterOptions,
    EngineFlags,
    LaunchConfig,
    banaserve_flags,
    cpu_dtype,
    drop_flags,
)
from banaserve.config.client_limits import raise_descriptor_limit
from banaserve.config.pipeline_options import BOUNDARY_FLAG, lending_split
from banaserve.config.store_options import KvStoreOptions
from banaserve.kvstore.embedded import proves_token
from banaserve.platform import cpu_platform_wanted
from banaserve.router.placement import NoStorePlacer, Placer
from banaserve.server.kv_pool_sizing import available_memory_bytes, size_kv_pool
from banaserve.server.memory_plan import MemoryPlan, host_pool_ratio, plan_memory
from banaserve.utils.processes import ChildFailed, ManagedProcess, exit_on_sigterm, free_port

logger = logging.getLogger("banaserve.cluster")

#: Flags each instance gets from the cluster, not from the user's argv.
INSTANCE_VALUE_FLAGS = (*KV_STORE_VALUE_FLAGS, "--kv-pool-memory-fraction")
GATEWAY_VALUE_FLAGS = ("--host", "--port")


def instance_launch_argv(
    argv: list[str], store: KvStoreOptions | None, urls: list[str], model_path: str,
    instances: int, kv_pool_memory_fraction: float,
) -> list[str]:  # fmt: skip
    """The user's argv for one instance: without cluster, gateway and store flags, attached to
    the cluster's store (none with ``store`` None), with a share of the KV pool memory."""
    cluster_values, cluster_switches = banaserve_flags(CLUSTER_GROUP)
    out = drop_flags(
        argv, cluster_values + INSTANCE_VALUE_FLAGS + GATEWAY_VALUE_FLAGS, cluster_switches
    )
    if not any(a.split("=", 1)[0] == "--model-path" for a in out):
        out += ["--model-path", model_path]
    if store is not None:
        out += store.instance_flags(urls)
    out += ["--kv-pool-memory-fraction", str(kv_pool_memory_fraction / instances)]
    return out


def memory_plan(
    args: EngineFlags, store: KvStoreOptions | None, model_path: str, instances: int
) -> MemoryPlan | None:
    """The cluster's host-memory plan on the CPU engine; None where pools are device memory,
    the model is not a local folder, or the user turned BanaServe's CPU defaults off. Sized
    for the dtype the instances' own CPU defaults give them (``cpu_dtype``), so that the KV
    pools planned here are the ones they allocate."""
    if not cpu_platform_wanted() or args.no_cpu_defaults:
        return None
    model_dir = Path(model_path)
    if not (model_dir / "config.json").is_file():
        return None
    available = available_memory_bytes()
    dtype = cpu_dtype(args.dtype)
    # The linker loads into the KV pool: no host pool; nor is there one without a store.
    uses_hicache = store is not None and store.mode == "hicache"
    ratio = host_pool_ratio(uses_hicache, args.hicache_ratio, args.hicache_size)
    tokens = (
        args.max_total_tokens
        or size_kv_pool(
            model_dir, args.kv_pool_memory_fraction / instances, dtype, available, ratio
        ).tokens
    )
    return plan_memory(
        model_dir, instances, tokens, dtype, ratio,
        args.hicache_size if uses_hicache else 0.0,
        store.capacity_gb if store is not None and store.embedded else 0.0, available,
    )  # fmt: skip


def run_cluster(plan: LaunchConfig) -> None:
    """Run the cluster ``plan`` describes until Ctrl-C/SIGTERM (its ``kv_store`` None: with no
    KV store at all); raise ChildFailed when start-up fails, and before starting anything
    MemoryPlanError when the plan does not fit in host memory and ValueError when the layout
    cannot be made (no core to lend a decode instance's layers to)."""
    from banaserve.env import ADMIN_TOKEN_ENV, TOKEN_ENV
    from banaserve.server.store_start import start_store

    exit_on_sigterm()  # so a SIGTERM during start-up still stops what was started
    options, store, argv, args = plan.cluster, plan.kv_store, plan.argv, plan.flags
    model_path = plan.served_names[1]
    if options is None or args is None:
        raise ValueError("not a cluster: no --num-prefill/--num-decode")
    count = options.num_prefill + options.num_decode
    memory = memory_plan(args, store, model_path, count)
    if memory is not None:
        logger.info("memory plan: %s", memory.describe())
        memory.check()
    # Before anything starts: a layout that cannot work fails here (ValueError).
    cores = plan_cores(count, sorted(os.sched_getaffinity(0))) if options.cpu_affinity else None
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    specs = plan_instances(options.num_prefill, options.num_decode, sorted(ports), cores)
    lending = None
    if options.migration == "layer":
        split = lending_split(args.pp_layer_boundary, args.pp_size, Path(model_path))
        specs = lend_decode_layers(specs, split)
        lending = LayerLending(split, LayerLayout.of(specs, split), cpu_dtype(args.dtype))
    log_dir = Path(options.log_dir) if options.log_dir else default_log_dir()
    log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the logs hold the admin token
    logger.info("cluster logs in %s", log_dir)
    ledger = LeftoverLedger(log_dir / "children.json")
    reaper = Reaper(ledger.path, log_dir / "reaper.log")
    token: str | None = None
    urls: list[str] = []
    store_process: ManagedProcess | None = None
    processes: ClusterProcesses | None = None
    try:
        if store is not None:
            started = start_store(store, log_dir)
            urls, token, store_process = started.urls, started.token, started.process
        if store_process is not None:
            ledger.add_session(store_process.pid)
            logger.info("embedded KV store at %s (pid %d)", urls[0], store_process.pid)
        processes = ClusterProcesses(log_dir, store_process)
        launch = instance_launch_argv(
            argv, store, urls, model_path, count, args.kv_pool_memory_fraction
        )
        if lending is not None:
            launch = drop_flags(launch, (BOUNDARY_FLAG,), ())  # the decode instances' alone
        admin_token = admin_token_for(args.admin_api_key, log_dir)
        # Each instance's launcher makes it its --admin-api-key (never in argv: ps shows it).
        env = dict(os.environ, **{ADMIN_TOKEN_ENV: admin_token})
        if token:
            env[TOKEN_ENV] = token
        processes.start(
            specs, launch, env,
            on_started=lambda child: ledger.add_session(child.process.pid),
            while_waiting=ledger.scan,
        )  # fmt: skip
        asyncio.run(
            serve_gateway(
                processes, specs, options, urls, token, model_path,
                args.host, args.port, ledger, lending, args.api_key, admin_token,
                plan.allowed_hosts,
            )
        )  # fmt: skip
    finally:
        if processes is not None:
            processes.stop()
        elif store_process is not None:
            store_process.stop()
        ledger.scan()  # anything mapped at the very end
        _, removed = clean_up(ledger.path, wait_s=0)
        if removed:
            logger.info("removed %d shared-memory files the instances left", removed)
        reaper.stop()


async def model_limits(
    model_path: str, specs: list[Any], max_token_bytes: int | None, api_key: str | None
) -> ModelLimits | None:
    """The model's vocabulary and context, the latter as an instance reports it (SGLang
    derives it from the config and ``--context-length``); None if either is unknown."""
    import aiohttp

    vocab = model_vocab_size(model_path)
    context = None
    async with aiohttp.ClientSession(
        headers=bearer(api_key), timeout=aiohttp.ClientTimeout(total=30)
    ) as session:
        for spec in specs:
            try:
                async with session.get(f"{spec.url}/v1/models") as response:
                    context = (await response.json())["data"][0]["max_model_len"]
                    break
            except (aiohttp.ClientError, OSError, KeyError, IndexError, ValueError):
                continue
    if vocab is None or not isinstance(context, int):
        logger.warning("model limits unknown (vocab %s, context %s): token ids unchecked",
                       vocab, context)  # fmt: skip
        return None
    # Without a tokenizer, one character per byte is the only safe bound on token length.
    return ModelLimits(vocab, context, max_token_bytes or 1 << 20)


async def serve_gateway(
    processes: ClusterProcesses, specs: list[Any], options: ClusterOptions, urls: list[str],
    token: str | None, model_path: str, host: str, port: int, ledger: LeftoverLedger,
    lending: LayerLending | None = None, api_key: str | None = None,
    admin_token: str | None = None, allowed_hosts: frozenset[str] | None = None,
) -> None:  # fmt: skip
    import aiohttp

    from banaserve.kvstore.client import KvStoreClient
    from banaserve.router.policies import make_policy

    board = LoadBoard(specs, stall_after_s=options.stall_timeout_s)
    count_tokens, max_token_bytes = await asyncio.to_thread(load_tokenizer, model_path)
    limits = await model_limits(model_path, specs, max_token_bytes, api_key)
    # No URLs: --kv-store none, so no client, no handoff (NoStorePlacer), /cluster store null.
    store_client = await asyncio.to_thread(KvStoreClient, urls, token) if urls else None
    ready_timeout = aiohttp.ClientTimeout(total=5)

    async def ready(child: Child) -> bool:
        if child.url is None:  # the store: back once it proves it holds the token
            return await asyncio.to_thread(proves_token, urls[0], token)
        assert gateway.session is not None
        async with gateway.session.get(f"{child.url}/health", timeout=ready_timeout) as r:
            return r.status == 200

    def respecced(spec: InstanceSpec) -> None:
        if isinstance(migration, LayerMigration):
            migration.record_fallback(spec, time.monotonic())

    supervisor = Supervisor(processes, board, ready, options.restart_policy, ledger,
                            on_respecced=respecced)  # fmt: skip

    async def extra_info() -> dict[str, Any]:
        stats = await asyncio.to_thread(store_client.stats) if store_client else None
        pids = {i.name: i.process.pid for i in processes.children}
        return {"store": stats, "log_dir": str(processes.log_dir), "pids": pids}

    placer_class = Placer if store_client is not None else NoStorePlacer
    migration: RoleMigration | LayerMigration | None = None
    if options.migration == "role":
        migration = RoleMigration.for_board(board, options.migration_costs.role_config())
    elif lending is not None:
        migration = LayerMigration.for_cluster(
            board, specs, lending.split, lending.layout, Path(model_path), lending.dtype,
            options.migration_costs.layer_config(options.migration_predictive),
            instance_headers=bearer(api_key),
            admin_headers=bearer(admin_token),
        )  # fmt: skip
    gateway = Gateway(
        board,
        make_policy(options.router_policy, PREFILL),
        make_policy(options.router_policy, DECODE),
        Intake(options.request_limits, limits, count_tokens),
        placer_class(options.handoff_min_tokens, options.in_place_max_new_tokens),
        extra_info,
        supervisor,
        clear_store=store_client.clear if store_client is not None else None,
        migration=migration,
        spill_prefill=options.spill_prefill,
        serve_on_spare_prefill=options.serve_on_spare_prefill,
        api_key=api_key,
        admin_token=admin_token,
        allowed_hosts=allowed_hosts,
        client_limits=options.client_limits,
    )
    runner = gateway_runner(gateway.app(), options.client_limits)
    await runner.setup()
    cap = options.client_limits.connections(raise_descriptor_limit())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = []
    try:
        await CappedSite(runner, host, port, cap).start()
        assert gateway.session is not None
        tasks = [
            asyncio.create_task(poll_forever(board, gateway.session)),
            asyncio.create_task(supervisor.run()),
        ]
        if migration is not None:
            tasks.append(asyncio.create_task(migration.run_forever()))
        prefill = sum(s.role == PREFILL for s in specs)
        logger.info(
            "BanaServe cluster serving on http://%s:%d: %d prefill + %d decode, router %s, "
            "store %s, migration %s, at most %d client connections", host, port, prefill,
            len(specs) - prefill, options.router_policy, ",".join(urls) or "none (no handoff)",
            options.migration, cap,
        )  # fmt: skip
        await stop.wait()
        logger.info("stopping the cluster")
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await runner.cleanup()
        if store_client is not None:
            store_client.close()


__all__ = ["ChildFailed", "run_cluster"]
