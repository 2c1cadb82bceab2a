"""The systems ``compare.py`` measures, and how each starts, clears its caches and stops.

Every system's SGLang instances get the same engine flags from one function,
:func:`instance_flags` (model dtype, KV pool, page size, metrics), and the systems that keep a
host KV pool get the same one (:func:`host_pool_flags`); pinning uses BanaServe's own core plan
for the same number of instances, so equal layouts get equal cores.

Families (``SystemSpec.family``):

- ``banaserve``: ``launch_server --num-prefill 2 --num-decode 1`` (load_aware routing, the Global
  KV Cache Store, handoff through it, in-place execution of short requests); its ablations add
  flags (``--kv-store none``, ``--router-policy cache_aware``, ...);
- ``coloc``: ``n`` plain SGLang instances behind sglang-router (``coloc.py``); ``coloc_hicache``
  adds SGLang's HiCache with a shared ``file`` L3;
- ``pd``: stock SGLang PD over ``mooncake_tcp``, 2 prefill + 1 decode, behind sglang-router in
  PD mode (``stock_pd.py``); ``pd_radix`` keeps a radix cache on the decode instance too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from banaserve.cluster.topology import plan_cores
from banaserve.server.memory_plan import DEFAULT_HICACHE_RATIO
from banaserve.utils.processes import ManagedProcess, free_port

REPO = Path(__file__).resolve().parents[1]
NUM_PREFILL, NUM_DECODE = 2, 1
START_TIMEOUT_S = 900.0
#: Seconds a refused cache flush is retried (:func:`post_until_done`).
FLUSH_RETRY_S = 30.0
#: SGLang's page size on every system (BanaServe's store pages follow it).
PAGE_SIZE = 16
#: ``--in-place-max-new-tokens`` that admits every request anywhere (longer than any output).
ANY_LENGTH = 1 << 30


@dataclass(frozen=True)
class Budget:
    """What every system gets: engine dtype, each instance's KV pool (tokens), the host pool
    relative to it where a system keeps one, and BanaServe's store RAM."""

    dtype: str = "float32"
    kv_tokens: int = 16384
    host_ratio: float = DEFAULT_HICACHE_RATIO
    #: Cache pressure's prefixes take about 2.4 GB.
    store_gb: float = 3.0


@dataclass(frozen=True)
class SystemSpec:
    name: str
    family: str  # "banaserve" | "coloc" | "pd"
    policy: str = ""
    instances: int = NUM_PREFILL + NUM_DECODE
    #: ``coloc``: SGLang's HiCache with a shared file L3. ``pd``: radix cache on decode.
    shared_cache: bool = False
    #: ``banaserve``: flags of an ablation or a variant.
    extra: tuple[str, ...] = ()
    #: Left out of "the best baseline": BanaServe itself and its ablations.
    ours: bool = False
    #: ``banaserve``: its prefill and decode instances.
    prefill: int = NUM_PREFILL
    decode: int = NUM_DECODE
    #: ``banaserve``: a checkout whose ``python/`` its processes import instead (an A/B of
    #: two commits in one run: ``compare.py --base-tree``).
    tree: Path | None = None

    @property
    def migrates(self) -> bool:
        """Runs ``--migration role`` or ``layer``: reset between workloads and runs, and its
        moves counted."""
        flags = list(self.extra)
        return "--migration" in flags and flags[flags.index("--migration") + 1] != "off"


def known_systems() -> dict[str, SystemSpec]:
    specs = [
        SystemSpec("banaserve", "banaserve", ours=True),
        SystemSpec("banaserve_linker", "banaserve", extra=("--kv-store-mode", "linker"), ours=True),
        # Whole instances change role as the load turns (migration, mechanism 4).
        SystemSpec("banaserve_role", "banaserve", extra=("--migration", "role"), ours=True),
        # The decode instance runs its later layers on prefill-1's core, the boundary moved by
        # the layer controller.
        SystemSpec("banaserve_layer", "banaserve", extra=("--migration", "layer"), ours=True),
        # Long requests too run on whichever instance's cores are least busy, prefill
        # instances included (decided per request at route time, not by a controller).
        SystemSpec("banaserve_any_instance", "banaserve", ours=True,
                   extra=("--in-place-max-new-tokens", str(ANY_LENGTH))),
        # Roles as walls: every long request decodes on a decode instance, however idle the
        # prefill instances' cores (the default before issue 30's spare-prefill routing).
        SystemSpec("banaserve_walls", "banaserve", ours=True,
                   extra=("--serve-on-spare-prefill", "off")),
        # Ablations: one mechanism off each.
        SystemSpec("banaserve_no_store", "banaserve", extra=("--kv-store", "none"), ours=True),
        SystemSpec("banaserve_pure_pd", "banaserve", ours=True,
                   extra=("--handoff-min-tokens", "0", "--in-place-max-new-tokens", "0")),
        SystemSpec("banaserve_no_in_place", "banaserve", ours=True,
                   extra=("--in-place-max-new-tokens", "0")),
        SystemSpec("banaserve_cache_aware", "banaserve", ours=True,
                   extra=("--router-policy", "cache_aware")),
        # A request whose pages another request is computing computes them again instead of
        # waiting for them (the wait holds the instance's one store-lookup thread).
        SystemSpec("banaserve_no_coalesce", "banaserve", ours=True,
                   extra=("--kv-store-coalesce-wait-s", "0")),
        # A new request is scheduled without waiting for its store lookup (SGLang's default,
        # "timeout", holds it in the queue until the lookup and any transfer end or time out).
        SystemSpec("banaserve_prefetch_best_effort", "banaserve", ours=True,
                   extra=("--hicache-storage-prefetch-policy", "best_effort")),
        # One prefill and one decode instance, each on a core of its own (no core shared by
        # two instances' batches); every instance still takes any request (spare prefill).
        SystemSpec("banaserve_1p1d", "banaserve", ours=True, instances=2, prefill=1, decode=1),
        # Round robin: with a shared cache, affinity is the cache's job, not the router's.
        SystemSpec("coloc_hicache", "coloc", "round_robin", instances=2, shared_cache=True),
        *(SystemSpec(f"coloc_{n}_{p}", "coloc", p, instances=n)
          for n in (2, 3) for p in ("round_robin", "cache_aware", "power_of_two")),
        *(SystemSpec(f"stock_{p}", "pd", p)
          for p in ("cache_aware", "round_robin", "power_of_two")),
        SystemSpec("pd_radix", "pd", "cache_aware", shared_cache=True),
    ]  # fmt: skip
    return {spec.name: spec for spec in specs}


ABLATIONS = ("banaserve_no_store", "banaserve_pure_pd", "banaserve_no_in_place",
             "banaserve_cache_aware", "banaserve_no_coalesce")  # fmt: skip


def instance_flags(budget: Budget) -> list[str]:
    """The engine flags of every instance of every system."""
    # --enable-metrics: per-instance request counts, hit rates and the attribution.
    return ["--dtype", budget.dtype, "--max-total-tokens", str(budget.kv_tokens),
            "--page-size", str(PAGE_SIZE), "--sleep-on-idle", "--log-level", "warning",
            "--enable-metrics"]  # fmt: skip


def host_pool_flags(budget: Budget) -> list[str]:
    """The host KV pool of the systems that keep one (HiCache), the same size on each."""
    return ["--hicache-ratio", str(budget.host_ratio)]


@dataclass
class Running:
    """A started system: its front URL, its instances by role, how to clear every cache it
    keeps (instances, host pools, shared stores, the gateway's index) and how to stop it."""

    url: str
    prefill_urls: list[str]
    decode_urls: list[str]
    clear: Callable[[], None]
    stop: Callable[[], None]
    #: Instances whose answer reaches the client (their e2e minus TTFT is decode time).
    answering: list[bool] = field(default_factory=list)
    #: Cache memory of this system, for the budgets table.
    cache_budget: str = ""

    @property
    def urls(self) -> list[str]:
        return self.prefill_urls + self.decode_urls


#: The admin token of the clusters the benchmarks start (for /clear_caches, /migration and
#: the full /cluster); made per run, never written down.
BENCH_ADMIN_TOKEN = os.urandom(16).hex()


def post(url: str, body: dict | None = None, timeout: float = 120.0) -> bytes:
    """POST ``body`` as JSON (no body: an empty one), as the clusters' admin (SGLang
    baselines ignore the header); the answer's bytes."""
    data, headers = b"", {"Authorization": f"Bearer {BENCH_ADMIN_TOKEN}"}
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def post_until_done(url: str) -> bytes:
    """``post`` a cache flush, again each second for :data:`FLUSH_RETRY_S` while it is refused:
    SGLang flushes only an idle instance, and right after a run's last answer an instance may
    still count a request as pending (seen: "Cache not flushed because there are pending
    requests. #queue-req: 0, #running-req: 0")."""
    deadline = time.monotonic() + FLUSH_RETRY_S
    while True:
        try:
            return post(url)
        except urllib.error.HTTPError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(1.0)


def flush_instances(urls: list[str], l3: bool = False) -> None:
    """Flush each instance's radix cache (and host pool); with ``l3`` its HiCache storage too."""
    for url in urls:
        post_until_done(f"{url}/flush_cache")
        if l3:
            post(f"{url}/hicache/storage-backend/clear")


def clear_banaserve(url: str, migrates: bool) -> None:
    """Every cache of the cluster cold, and with migration every instance back in its home
    role (or at its start boundary): a workload must not start where the last one left
    them."""
    post_until_done(f"{url}/clear_caches")
    if migrates:
        post(f"{url}/migration", {"reset": True}, timeout=30)


def banaserve_env(tree: Path | None = None) -> dict[str, str]:
    """The environment of BanaServe's processes: ``tree``'s source (a checkout) where given;
    else the installed package where it has its built extension (``--kv-store-mode linker``
    needs ``banaserve._C``), else this source tree."""
    env = dict(os.environ, BANASERVE_ADMIN_TOKEN=BENCH_ADMIN_TOKEN)
    if tree is not None:
        return dict(env, PYTHONPATH=str(tree.resolve() / "python"))
    probe = [sys.executable, "-c", "import banaserve._C"]
    if subprocess.run(probe, capture_output=True, cwd="/").returncode == 0:
        return env
    return dict(env, PYTHONPATH=str(REPO / "python"))


def banaserve_argv(spec: SystemSpec, model: str, budget: Budget, port: int, log_dir: Path,
                   pin: bool) -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", "banaserve.launch_server", "--model-path", model,
        "--num-prefill", str(spec.prefill), "--num-decode", str(spec.decode),
        "--port", str(port), "--cluster-log-dir", str(log_dir),
        "--kv-store", "embedded", "--kv-store-capacity-gb", str(budget.store_gb),
        *instance_flags(budget), *host_pool_flags(budget),
        *(["--cpu-affinity"] if pin else []), *spec.extra,
    ]  # fmt: skip


@contextmanager
def start_banaserve(
    spec: SystemSpec, model: str, budget: Budget, out: Path, pin: bool
) -> Iterator[Running]:
    port = free_port()
    argv = banaserve_argv(spec, model, budget, port, out / spec.name, pin)
    process = ManagedProcess(spec.name, argv, out / spec.name / "gateway.log",
                             env=banaserve_env(spec.tree))  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        process.wait_http_ok(f"{url}/health", START_TIMEOUT_S, progress_every=30)
        state = json.loads(urllib.request.urlopen(f"{url}/cluster", timeout=30).read())
        by_role: dict[str, list[str]] = {"prefill": [], "decode": []}
        for instance in state["instances"]:
            by_role[instance["home_role"]].append(instance["url"])
        no_store = "none" in spec.extra
        yield Running(
            url, by_role["prefill"], by_role["decode"],
            clear=lambda: clear_banaserve(url, spec.migrates),
            stop=process.stop,
            answering=[True] * len(state["instances"]),
            cache_budget=f"KV {budget.kv_tokens} tok x {spec.prefill + spec.decode}" + (
                "" if no_store else
                f" + host pool {budget.host_ratio}x each + store {budget.store_gb} GB RAM"),
        )  # fmt: skip
    finally:
        process.stop(grace=60)


def l3_folder(spec: SystemSpec, out: Path) -> Path:
    return out / spec.name / "hicache-l3"


def coloc_flags(spec: SystemSpec, budget: Budget, out: Path) -> list[str]:
    from coloc import shared_l3_flags

    flags = instance_flags(budget)
    if spec.shared_cache:
        flags += [*host_pool_flags(budget), *shared_l3_flags(l3_folder(spec, out))]
    return flags


def instance_argv(spec: SystemSpec, model: str, budget: Budget, out: Path) -> list[str]:
    """The command line that starts ``spec``'s first instance (BanaServe: its launcher, whose
    flags every instance gets), as the starters build it; for checking that systems agree."""
    if spec.family == "banaserve":
        return banaserve_argv(spec, model, budget, 0, out / spec.name, pin=False)
    if spec.family == "coloc":
        from sglang_launch import server_argv

        return server_argv(model, 0, coloc_flags(spec, budget, out))
    from stock_pd import pd_server_argv

    return pd_server_argv(model, 0, "prefill", 0, instance_flags(budget))


def cores_for(instances: int, pin: bool) -> list[tuple[int, ...]] | None:
    return plan_cores(instances, sorted(os.sched_getaffinity(0))) if pin else None


@contextmanager
def start_coloc(
    spec: SystemSpec, model: str, budget: Budget, out: Path, pin: bool
) -> Iterator[Running]:
    from coloc import start_colocated

    if spec.shared_cache:
        shutil.rmtree(l3_folder(spec, out), ignore_errors=True)
    group = start_colocated(
        model, spec.instances, spec.policy, out / spec.name,
        cores_for(spec.instances, pin), coloc_flags(spec, budget, out),
    )  # fmt: skip
    with group:
        urls = group.worker_urls
        yield Running(
            group.url, [], urls, clear=lambda: flush_instances(urls, spec.shared_cache),
            stop=group.stop, answering=[True] * len(urls),
            cache_budget=f"KV {budget.kv_tokens} tok x {spec.instances}" + (
                f" + host pool {budget.host_ratio}x each + file L3 on disk (unbounded)"
                if spec.shared_cache else ""),
        )  # fmt: skip


@contextmanager
def start_pd(
    spec: SystemSpec, model: str, budget: Budget, out: Path, pin: bool
) -> Iterator[Running]:
    from stock_pd import start_stock_pd

    policy, router_args = spec.policy, ()
    if policy == "power_of_two" and NUM_DECODE < 2:
        # sglang-router's power_of_two needs two workers of a role: one decode gets them all.
        policy, router_args = "round_robin", ("--prefill-policy", "power_of_two")
    decode_args = ("--disaggregation-decode-enable-radix-cache",) if spec.shared_cache else ()
    with start_stock_pd(
        model, NUM_PREFILL, NUM_DECODE, policy, None, out / spec.name,
        cores_for(NUM_PREFILL + NUM_DECODE, pin), instance_flags(budget),
        router_args=router_args, decode_args=decode_args,
    ) as pd:  # fmt: skip
        urls = pd.prefill_urls + pd.decode_urls
        yield Running(
            pd.url, list(pd.prefill_urls), list(pd.decode_urls),
            clear=lambda: flush_instances(urls), stop=pd.stop,
            answering=[False] * NUM_PREFILL + [True] * NUM_DECODE,
            cache_budget=f"KV {budget.kv_tokens} tok x 3 (decode: + 0.2x retraction pool)",
        )  # fmt: skip


STARTERS = {"banaserve": start_banaserve, "coloc": start_coloc, "pd": start_pd}


def start_system(
    spec: SystemSpec, model: str, budget: Budget, out: Path, pin: bool
) -> contextlib.AbstractContextManager[Running]:
    return STARTERS[spec.family](spec, model, budget, out, pin)


def prerequisites(spec: SystemSpec) -> str:
    """Why ``spec`` cannot run on this machine, in one line ("" if it can)."""
    import importlib.util

    if spec.family == "pd":
        from stock_pd import missing_prerequisites

        return missing_prerequisites()
    if spec.family == "coloc" and importlib.util.find_spec("sglang_router") is None:
        return "the colocated baseline needs sglang-router (pip install '.[bench]')"
    return ""
