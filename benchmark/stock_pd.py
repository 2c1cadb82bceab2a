"""Stock SGLang prefill/decode disaggregation (PD), as it ships: a baseline BanaServe is
compared against.

``start_stock_pd`` starts ``num_prefill`` prefill and ``num_decode`` decode servers
(``python -m sglang.launch_server --disaggregation-mode prefill|decode
--disaggregation-transfer-backend mooncake_tcp``, each prefill with its own bootstrap port),
waits for each ``/health``, then starts sglang-router in PD mode
(``python -m sglang_router.launch_router --pd-disaggregation --prefill URL BOOTSTRAP_PORT
--decode URL --policy POLICY``) and waits until it answers ``/health`` and lists the model
on ``/v1/models``.

Router policies (``--policy``, used for prefill and decode alike): ``cache_aware``,
``round_robin``, ``power_of_two`` (needs at least 2 workers of each kind, prefill and
decode), ``random``. ``cache_aware`` takes ``--cache-threshold`` (default 0.3),
``--balance-abs-threshold`` (64) and ``--balance-rel-threshold`` (1.5): pass them in
``router_args``. ``--prefill-policy``/``--decode-policy`` override the policy per role.

Needs Debian ``libibverbs1`` and the pip packages ``mooncake-transfer-engine-non-cuda`` and
``sglang-router`` (:func:`missing_prerequisites` says which are missing).

Usage, a quick smoke run: ``python benchmark/stock_pd.py --model /tmp/tiny-llama
--num-prefill 1 --num-decode 1`` starts it all, sends one request, prints it and stops.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import subprocess
import sys
import time
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

#: Policies ``sglang_router.launch_router --policy`` accepts (``manual`` needs routing keys).
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")

#: Decode servers back up retracted requests in a HiCache host pool sized, by default, from
#: the host memory left after a 10 GiB reserve: on a 24 GiB machine with other servers up,
#: start-up then fails ("No host memory is left for HiCache"). The explicit ratio is SGLang's
#: own default for that pool (0.2 of the device pool), without the auto-sizing.
CPU_DECODE_ARGS = ("--hicache-ratio", "0.2")


class StockPd(ServerGroup):
    """Running stock PD servers and their router (see :class:`ServerGroup`)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        #: Bootstrap port of each prefill server, in ``prefill_urls`` order.
        self.bootstrap_ports: list[int] = []

    def __enter__(self) -> StockPd:
        return self


@functools.cache  # a subprocess each time; compare.py asks once per stock PD system
def missing_prerequisites() -> str:
    """What stock PD lacks on this machine, in one line ("" if nothing): Mooncake's engine
    loads ``libibverbs`` even for TCP, and fails with a long traceback without it."""
    probe = [sys.executable, "-c", "import mooncake.engine, sglang_router.launch_router"]
    run = subprocess.run(probe, capture_output=True, text=True, cwd="/")
    if run.returncode == 0:
        return ""
    if "libibverbs" in run.stderr:
        return "stock PD needs Debian libibverbs1 (sudo apt-get install libibverbs1)"
    for module, package in (("mooncake", "mooncake-transfer-engine-non-cuda"),
                            ("sglang_router", "sglang-router")):  # fmt: skip
        if importlib.util.find_spec(module) is None:
            return f"stock PD needs {package} (pip install '.[bench]')"
    return f"stock PD cannot load Mooncake: {run.stderr.strip().splitlines()[-1:]}"


def pd_server_argv(
    model_path: str | Path, port: int, mode: str, bootstrap_port: int, flags: Sequence[str]
) -> list[str]:
    return server_argv(model_path, port, [
        *(CPU_DECODE_ARGS if mode == "decode" else ()),
        "--disaggregation-mode", mode,
        "--disaggregation-transfer-backend", "mooncake_tcp",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
        *flags,
    ])  # fmt: skip


def start_stock_pd(
    model_path: str | Path,
    num_prefill: int,
    num_decode: int,
    policy: str,
    port: int | None,
    log_dir: str | Path,
    cores: list[tuple[int, ...]] | None = None,
    extra_args: Sequence[str] = (),
    *,
    router_args: Sequence[str] = (),
    router_cores: tuple[int, ...] | None = None,
    start_timeout: float = SERVER_START_TIMEOUT,
    decode_args: Sequence[str] = (),
) -> StockPd:
    """Start stock SGLang PD on ``model_path`` with its router on ``127.0.0.1:port``.

    ``port`` None: a free port picked when the router starts (see
    :func:`sglang_launch.start_router`).

    ``cores``: one tuple per instance, prefill instances first, then decode; an instance runs
    under ``taskset -c`` on its cores with ``OMP_NUM_THREADS`` = their number. ``None`` leaves
    every instance unpinned with ``OMP_NUM_THREADS`` as inherited (1 if unset).
    ``extra_args`` go to every server, ``decode_args`` to decode servers after them,
    ``router_args`` to the router (e.g. ``("--balance-abs-threshold", "8")``). Logs:
    ``log_dir/{prefill0,…,decode0,…,router}.log``.

    Blocks until everything serves; raises ``ChildFailed`` (quoting the log) if a process
    dies or times out, after stopping everything it started.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if num_prefill < 1 or num_decode < 1:
        raise ValueError("PD needs at least one prefill and one decode instance")
    if cores is not None and len(cores) != num_prefill + num_decode:
        raise ValueError(
            f"cores: {len(cores)} entries for {num_prefill + num_decode} instances "
            "(prefill first, then decode)"
        )
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    pd = StockPd(f"http://127.0.0.1:{port or 0}")
    try:
        roles = ["prefill"] * num_prefill + ["decode"] * num_decode
        for index, role in enumerate(roles):
            number = index if role == "prefill" else index - num_prefill
            server_port, bootstrap_port = free_port(), free_port()
            flags = [*extra_args, *(decode_args if role == "decode" else ())]
            argv = pd_server_argv(model_path, server_port, role, bootstrap_port, flags)
            start_server(pd, f"{role}{number}", argv, cores[index] if cores else None, log_dir)
            url = f"http://127.0.0.1:{server_port}"
            if role == "prefill":
                pd.prefill_urls.append(url)
                pd.bootstrap_ports.append(bootstrap_port)
            else:
                pd.decode_urls.append(url)
        wait_servers(pd, pd.prefill_urls + pd.decode_urls, start_timeout)

        def router_argv(router_port: int, metrics_port: int) -> list[str]:
            argv = [*router_base_argv(router_port, metrics_port),
                    "--pd-disaggregation", "--policy", policy]  # fmt: skip
            for url, bootstrap_port in zip(pd.prefill_urls, pd.bootstrap_ports, strict=True):
                argv += ["--prefill", url, str(bootstrap_port)]
            for url in pd.decode_urls:
                argv += ["--decode", url]
            return argv + list(router_args)

        start_router(pd, port, router_argv, router_cores, log_dir)
        return pd
    except BaseException:
        pd.stop()
        raise


def _parse_cores(text: str | None) -> list[tuple[int, ...]] | None:
    """``"0;1;1"`` -> ``[(0,), (1,), (1,)]``; ``"0,1;1"`` -> ``[(0, 1), (1,)]``."""
    if not text:
        return None
    return [tuple(int(core) for core in part.split(",")) for part in text.split(";")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument("--policy", default="round_robin", choices=POLICIES)
    parser.add_argument("--port", type=int, default=0, help="router port (0: a free one)")
    parser.add_argument("--log-dir", default="/tmp/stock_pd_logs")
    parser.add_argument("--cores", help='per instance, prefill first: "0;1;1" or "0,1;1"')
    parser.add_argument("--serve", action="store_true", help="keep serving until Ctrl-C")
    args = parser.parse_args()
    missing = missing_prerequisites()
    if missing:
        sys.exit(missing)
    port = args.port or None
    with start_stock_pd(
        args.model, args.num_prefill, args.num_decode, args.policy, port, args.log_dir,
        _parse_cores(args.cores),
    ) as pd:  # fmt: skip
        answer = generate(
            pd.url,
            {"text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
        )
        print(json.dumps(answer.get("output_ids") or answer.get("text")))
        if args.serve:
            print(f"serving at {pd.url}; Ctrl-C stops", flush=True)
            try:
                while all(process.alive() for process in pd.processes):
                    time.sleep(1)
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
