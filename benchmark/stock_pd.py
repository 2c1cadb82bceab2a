"""Stock SGLang prefill/decode disaggregation (PD), as it ships: the baseline BanaServe is
compared against.

``start_stock_pd`` starts ``num_prefill`` prefill and ``num_decode`` decode servers
(``python -m sglang.launch_server --disaggregation-mode prefill|decode
--disaggregation-transfer-backend mooncake_tcp``, each prefill with its own bootstrap port),
waits for each ``/health``, then starts sglang-router in PD mode
(``python -m sglang_router.launch_router --pd-disaggregation --prefill URL BOOTSTRAP_PORT
--decode URL --policy POLICY``) and waits until it answers ``/health`` and lists the model
on ``/v1/models``. Nothing of BanaServe runs in these processes except the CPU platform
(``banaserve.platform``, including ``pd_cpu``), which the venv's ``.pth`` file applies to
every Python process on a machine without an NVIDIA driver.

Router policies (``--policy``, used for prefill and decode alike): ``cache_aware``,
``round_robin``, ``power_of_two`` (needs at least 2 workers of each kind, prefill and
decode), ``random``. ``cache_aware`` takes ``--cache-threshold`` (default 0.3),
``--balance-abs-threshold`` (64) and ``--balance-rel-threshold`` (1.5): pass them in
``router_args``. ``--prefill-policy``/``--decode-policy`` override the policy per role.

Needs Debian ``libibverbs1`` and the pip packages ``mooncake-transfer-engine-non-cuda`` and
``sglang-router``.

Usage, a quick smoke run: ``python benchmark/stock_pd.py --model /tmp/tiny-llama
--num-prefill 1 --num-decode 1`` starts it all, sends one request, prints it and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

from banaserve.utils.processes import ChildFailed, ManagedProcess, free_port  # noqa: E402

#: Policies ``sglang_router.launch_router --policy`` accepts (``manual`` needs routing keys).
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")

#: Server flags for the CPU; ``extra_args`` come after them, so they can override any.
CPU_SERVER_ARGS = (
    "--device", "cpu",
    "--max-total-tokens", "16384",
    "--sleep-on-idle",
    "--page-size", "16",
    "--log-level", "warning",
)  # fmt: skip

#: Decode servers back up retracted requests in a HiCache host pool sized, by default, from
#: the host memory left after a 10 GiB reserve: on a 24 GiB machine with other servers up,
#: start-up then fails ("No host memory is left for HiCache"). The explicit ratio is SGLang's
#: own default for that pool (0.2 of the device pool), without the auto-sizing.
CPU_DECODE_ARGS = ("--hicache-ratio", "0.2")

SERVER_START_TIMEOUT = 300.0
ROUTER_START_TIMEOUT = 120.0
ROUTER_START_ATTEMPTS = 3
PROGRESS_EVERY = 10.0


class StockPd:
    """Running stock PD servers and their router. ``url`` is the router's base URL.

    The owner stops it (``stop()`` or ``with``); stopping is idempotent and stops every
    process by its process group, the router first.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        #: Bootstrap port of each prefill server, in ``prefill_urls`` order.
        self.bootstrap_ports: list[int] = []
        self.servers: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None
        #: The router's Prometheus metrics (per-worker counters), ``None`` when disabled.
        self.metrics_url: str | None = None

    @property
    def processes(self) -> list[ManagedProcess]:
        return ([self.router] if self.router is not None else []) + self.servers

    def stop(self) -> None:
        for process in self.processes:
            process.stop()

    def __enter__(self) -> StockPd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _server_argv(
    model_path: Path, port: int, mode: str, bootstrap_port: int, extra_args: Sequence[str]
) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", "127.0.0.1", "--port", str(port),
        *CPU_SERVER_ARGS,
        *(CPU_DECODE_ARGS if mode == "decode" else ()),
        "--disaggregation-mode", mode,
        "--disaggregation-transfer-backend", "mooncake_tcp",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
        *extra_args,
    ]  # fmt: skip


def _env(cores: tuple[int, ...] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(len(cores)) if cores else env.get("OMP_NUM_THREADS", "1")
    # The CPU platform sets these itself where there is no NVIDIA driver; harmless otherwise.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    return env


def _pinned(argv: list[str], cores: tuple[int, ...] | None) -> list[str]:
    if not cores:
        return argv
    return ["taskset", "-c", ",".join(str(core) for core in cores), *argv]


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
) -> StockPd:
    """Start stock SGLang PD on ``model_path`` with its router on ``127.0.0.1:port``.

    ``port`` None: a free port picked when the router starts, after the servers are up (they
    and Mooncake open ports of their own while starting, so a port picked earlier may be
    taken by then); the router is then retried on a new port if its port was taken anyway.

    ``cores``: one tuple per instance, prefill instances first, then decode; an instance runs
    under ``taskset -c`` on its cores with ``OMP_NUM_THREADS`` = their number. ``None`` leaves
    every instance unpinned with ``OMP_NUM_THREADS`` as inherited (1 if unset).
    ``extra_args`` go to every server, ``router_args`` to the router (e.g.
    ``("--balance-abs-threshold", "8")``). Logs: ``log_dir/{prefill0,…,decode0,…,router}.log``.

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
    model_path = Path(model_path)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    pd = StockPd(f"http://127.0.0.1:{port or 0}")
    try:
        roles = ["prefill"] * num_prefill + ["decode"] * num_decode
        for index, role in enumerate(roles):
            number = index if role == "prefill" else index - num_prefill
            name = f"{role}{number}"
            server_port, bootstrap_port = free_port(), free_port()
            instance_cores = cores[index] if cores is not None else None
            argv = _server_argv(model_path, server_port, role, bootstrap_port, extra_args)
            process = ManagedProcess(
                name, _pinned(argv, instance_cores), log_dir / f"{name}.log",
                env=_env(instance_cores),
            )  # fmt: skip
            pd.servers.append(process)
            url = f"http://127.0.0.1:{server_port}"
            if role == "prefill":
                pd.prefill_urls.append(url)
                pd.bootstrap_ports.append(bootstrap_port)
            else:
                pd.decode_urls.append(url)
        # Started together, their start-ups overlap; wait for each in turn.
        for process, url in zip(pd.servers, pd.prefill_urls + pd.decode_urls, strict=True):
            took = process.wait_http_ok(f"{url}/health", start_timeout, PROGRESS_EVERY)
            print(f"[stock_pd] {process.name} healthy at {url} ({took:.0f} s)", file=sys.stderr)

        for attempt in range(1, ROUTER_START_ATTEMPTS + 1):
            router_port = port or free_port()
            pd.url = f"http://127.0.0.1:{router_port}"
            try:
                took = _start_router(pd, policy, router_port, router_args, router_cores, log_dir)
                break
            except ChildFailed as exc:
                taken = "Address already in use" in str(exc)
                if port is not None or not taken or attempt == ROUTER_START_ATTEMPTS:
                    raise
                print(f"[stock_pd] router port {router_port} taken; again", file=sys.stderr)
        _wait_models(pd, ROUTER_START_TIMEOUT)
        print(f"[stock_pd] router ({policy}) serving at {pd.url} ({took:.0f} s)", file=sys.stderr)
        return pd
    except BaseException:
        pd.stop()
        raise


def _start_router(
    pd: StockPd, policy: str, port: int, router_args: Sequence[str],
    cores: tuple[int, ...] | None, log_dir: Path,
) -> float:  # fmt: skip
    """Start the PD router on ``port``; return the seconds until ``/health`` answered."""
    if pd.router is not None:
        pd.router.stop()
    metrics_port = free_port()
    pd.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    argv = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--pd-disaggregation", "--policy", policy,
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip
    for url, bootstrap_port in zip(pd.prefill_urls, pd.bootstrap_ports, strict=True):
        argv += ["--prefill", url, str(bootstrap_port)]
    for url in pd.decode_urls:
        argv += ["--decode", url]
    argv += list(router_args)
    pd.router = ManagedProcess(
        "router", _pinned(argv, cores), log_dir / "router.log", env=_env(cores)
    )
    return pd.router.wait_http_ok(f"{pd.url}/health", ROUTER_START_TIMEOUT, PROGRESS_EVERY)


def _wait_models(pd: StockPd, timeout: float) -> None:
    """Wait until the router lists a model: then it has registered its workers."""
    assert pd.router is not None
    deadline = time.monotonic() + timeout
    while True:
        if not pd.router.alive():
            raise pd.router.failure(f"exited with code {pd.router.process.returncode}")
        try:
            with urllib.request.urlopen(f"{pd.url}/v1/models", timeout=5) as response:
                if json.load(response).get("data"):
                    return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise pd.router.failure(f"lists no model at {pd.url}/v1/models after {timeout:.0f} s")
        time.sleep(0.5)


def generate(url: str, payload: dict, timeout: float = 120.0) -> dict:
    """POST ``payload`` to ``url/generate``; the decoded JSON answer."""
    request = urllib.request.Request(
        f"{url}/generate",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


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
