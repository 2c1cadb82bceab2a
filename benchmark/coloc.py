"""The colocated baseline, as a user of SGLang would run it on one machine: ``n`` plain
SGLang instances (``python -m sglang.launch_server``, no PD), each pinned to its cores, behind
``python -m sglang_router.launch_router --worker-urls … --policy POLICY``.

With ``shared_l3`` every instance also gets SGLang's own shared cache: HiCache with a host pool
and the ``file`` storage backend on one folder that all instances read and write
(``coloc_hicache`` in ``compare.py``).

Usage, a quick smoke run: ``python benchmark/coloc.py --model /tmp/tiny-llama --num 2``
starts it all, sends one request, prints it and stops.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from sglang_launch import (
    SERVER_START_TIMEOUT,
    ServerGroup,
    free_port,
    generate,
    router_base_argv,
    server_argv,
    start_router,
    start_server,
    wait_servers,
)

#: Policies of sglang-router's regular (non-PD) mode that balance without routing keys.
POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")


class Colocated(ServerGroup):
    """Running colocated instances (``worker_urls``) and their router (see :class:`ServerGroup`)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.worker_urls: list[str] = []

    def __enter__(self) -> Colocated:
        return self


def shared_l3_flags(folder: Path) -> list[str]:
    """HiCache over SGLang's ``file`` backend in ``folder``, shared by every instance: the same
    host-pool layout and prefetch policy as BanaServe's store backend, so only the L3 differs."""
    return [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(folder)}),
        "--hicache-mem-layout", "layer_first",
        "--hicache-io-backend", "direct",
        "--hicache-storage-prefetch-policy", "wait_complete",
    ]  # fmt: skip


def start_colocated(
    model_path: str | Path,
    num: int,
    policy: str,
    log_dir: str | Path,
    cores: list[tuple[int, ...]] | None = None,
    flags: Sequence[str] = (),
    *,
    port: int | None = None,
    router_args: Sequence[str] = (),
    start_timeout: float = SERVER_START_TIMEOUT,
) -> Colocated:
    """Start ``num`` instances of ``model_path`` with ``flags`` and a router on ``port`` (None:
    a free one). ``cores``: one tuple per instance (``taskset -c``, ``OMP_NUM_THREADS`` to
    match), or None for unpinned. Logs: ``log_dir/{worker0,…,router}.log``.

    Blocks until everything serves; raises ``ChildFailed`` (quoting the log) if a process dies
    or times out, after stopping everything it started."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if num < 1:
        raise ValueError("at least one instance")
    if cores is not None and len(cores) != num:
        raise ValueError(f"cores: {len(cores)} entries for {num} instances")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    group = Colocated(f"http://127.0.0.1:{port or 0}")
    try:
        for index in range(num):
            server_port = free_port()
            argv = server_argv(model_path, server_port, flags)
            start_server(group, f"worker{index}", argv, cores[index] if cores else None, log_dir)
            group.worker_urls.append(f"http://127.0.0.1:{server_port}")
        wait_servers(group, group.worker_urls, start_timeout)

        def router_argv(router_port: int, metrics_port: int) -> list[str]:
            return [*router_base_argv(router_port, metrics_port), "--policy", policy,
                    "--worker-urls", *group.worker_urls, *router_args]  # fmt: skip

        start_router(group, port, router_argv, None, log_dir)
        return group
    except BaseException:
        group.stop()
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num", type=int, default=2)
    parser.add_argument("--policy", default="round_robin", choices=POLICIES)
    parser.add_argument("--log-dir", default="/tmp/coloc_logs")
    args = parser.parse_args()
    with start_colocated(args.model, args.num, args.policy, args.log_dir) as group:
        payload = {"text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        print(json.dumps(generate(group.url, payload).get("text")))


if __name__ == "__main__":
    main()
