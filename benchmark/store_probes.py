"""Probes of the KV store under hostile clients (issue 13, items 4 and 5).

Starts a real store server (``python -m banaserve.kvstore.server --capacity-gb 0.25``, stopped
by its PID) and runs each hostile pattern of :mod:`store_hostile` against it: the
unauthenticated flood, oversized PUT announcements, half-sent PUTs, the connection cap, then a
store started without a token off loopback, where ucx:// and tcp:// listen, and per-tenant
isolation. Each probe passes or fails with a one-line detail; memory probes report the server's
peak resident memory against 1.5 x its capacity.

    python benchmark/store_probes.py [--workdir DIR]

prints a table; ``run_store_probes(workdir)`` returns the rows (``benchmark/reliability.py``).
Set ``BANASERVE_PROBE_SERVER_PATH`` to a directory holding another ``banaserve`` package to
probe that version of the server instead (the code before a change, say).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

import store_hostile as hostile  # noqa: E402
import store_hostile_patterns as patterns  # noqa: E402
from banaserve.kvstore.protocol import ErrorCode  # noqa: E402

TOKEN = "store-probes-token-0123456789"
TENANT_TOKENS = {"alpha": "alpha-probe-token-0123456789", "beta": "beta-probe-token-0123456789"}
MiB = 1 << 20

Probe = dict[str, Any]


def _row(probe: str, passed: bool, detail: str) -> Probe:
    return {"probe": probe, "passed": bool(passed), "detail": " ".join(detail.split())[:240]}


def _guarded(name: str, probe: Callable[[], Probe]) -> Probe:
    try:
        return probe()
    except Exception as exc:  # a probe that breaks is a failed probe, not a crash
        return _row(name, False, f"{type(exc).__name__}: {exc}")


def _memory(outcome: patterns.Outcome, limit: int) -> tuple[bool, str]:
    codes = ", ".join(f"{n} {code}" for code, n in sorted(outcome.codes().items()))
    detail = (
        f"peak RSS {outcome.peak_rss / MiB:.0f} MiB (limit {limit / MiB:.0f}), after "
        f"{outcome.rss_after / MiB:.0f} MiB (before {outcome.baseline_rss / MiB:.0f}); {codes}"
    )
    return outcome.peak_rss < limit and outcome.rss_after < limit, detail


def _memory_probes(store: hostile.StoreProcess) -> list[Probe]:
    limit = int(hostile.RSS_LIMIT_FACTOR * store.capacity_bytes)
    refusals = {ErrorCode.TOO_LARGE.value, ErrorCode.BUSY.value}
    rows = []
    monitor = hostile.Monitor(store.url, TOKEN)
    try:
        cases: list[tuple[str, Callable[..., Any], Callable[[patterns.Outcome], bool]]] = [
            (
                "unauthenticated flood (400 x 1 MiB control)",
                patterns.unauthenticated_flood,
                lambda o: set(o.codes()) <= refusals,
            ),
            (
                "oversized PUT announcements (2 x 1 GiB)",
                patterns.oversized_puts,
                lambda o: o.codes() == {ErrorCode.TOO_LARGE.value: len(o.errors)},
            ),
            (
                "half-sent legal PUTs (40)",
                patterns.half_sent_puts,
                lambda o: (
                    bool(o.notes.get("settled"))
                    and o.codes()[ErrorCode.BUSY.value] == len(o.errors) - o.notes["admitted"]
                ),
            ),
            (
                "strangers' connection cap full, a client with the token comes",
                patterns.connection_cap,
                lambda o: bool(o.notes["authenticated_served"] and o.notes["one_closed"]),
            ),
        ]
        for name, pattern, refused_right in cases:
            try:
                outcome = patterns.run_pattern(store, monitor, name, pattern(store, monitor))
                bounded, detail = _memory(outcome, limit)
                rows.append(_row(name, bounded and refused_right(outcome), detail))
            except Exception as exc:  # a probe that breaks is a failed probe, not a crash
                rows.append(_row(name, False, f"{type(exc).__name__}: {exc}"))
    finally:
        monitor.close()
    return rows


def _exposure_probes(workdir: Path, store: hostile.StoreProcess) -> list[Probe]:
    rows = []
    code, err = hostile.refused_start("--host", "0.0.0.0")
    reasons = [line.strip(" -") for line in err.splitlines() if line.startswith("  - ")]
    said = reasons[0].split(":")[0] if reasons else "started anyway" if code is None else err
    rows.append(
        _row(
            "no token off loopback is refused",
            code not in (None, 0) and "refuses to start" in err,
            f"--host 0.0.0.0 without a token: exit {code}, {said.strip()[:100]}",
        )
    )
    bound = hostile.listening(store.pid)
    rows.append(
        _row(
            "tcp:// and shm:// bind --host",
            bound == [("127.0.0.1", store.port)],
            f"--host 127.0.0.1 listens on {bound}",
        )
    )
    rows.append(_guarded(UCX_PROBE, lambda: _ucx_probe(workdir)))
    return rows


UCX_PROBE = "ucx:// binds no more than --host"


def _ucx_probe(workdir: Path) -> Probe:
    name = UCX_PROBE
    code, err = hostile.refused_start("--ucx-port", "0", token=TOKEN)
    refused = code not in (None, 0) and "ucx:// cannot bind" in err
    detail = f"--host 127.0.0.1 --ucx-port: {'refused' if refused else f'exit {code}'}"
    if importlib.util.find_spec("ucxx") is None:
        return _row(name, refused, detail + "; ucxx not importable: listener not started")
    env = {"UCX_WARN_UNUSED_ENV_VARS": "n"}
    args = ("--host", "0.0.0.0", "--ucx-port", "0")
    store = hostile.StoreProcess(workdir / "ucx", *args, token=TOKEN, env=env)
    try:
        ucx_port = int(store.first_line.split("ucx://")[1].split(")")[0].rsplit(":", 1)[1])
        hosts = {port: host for host, port in hostile.listening(store.pid)}
    finally:
        store.stop()
    wildcard = hosts.get(ucx_port) == "0.0.0.0" and hosts.get(store.port) == "0.0.0.0"
    detail += f"; --host 0.0.0.0: ucx listener on {hosts.get(ucx_port)}:{ucx_port}"
    return _row(name, refused and wildcard, detail)


TENANT_PROBE = "per-tenant tokens isolate keyspaces"


def _tenant_probe(workdir: Path) -> Probe:
    tokens = workdir / "tenant-tokens"
    tokens.write_text("".join(f"{t}:{k}\n" for t, k in TENANT_TOKENS.items()))
    tokens.chmod(0o600)
    store = hostile.StoreProcess(workdir / "tenants", "--tenant-tokens", str(tokens), token=TOKEN)
    try:
        problems = patterns.tenant_isolation(store.url, TENANT_TOKENS, TOKEN)
    finally:
        store.stop()
    detail = "; ".join(problems) or (
        "same raw key, separate pages; no probing across tenants; wrong token refused"
    )
    return _row(TENANT_PROBE, not problems, detail)


def run_store_probes(workdir: Path) -> list[Probe]:
    """Run every probe against store servers started under ``workdir`` (logs go there); each
    row is ``{"probe", "passed", "detail"}``. Every server is stopped before this returns."""
    workdir.mkdir(parents=True, exist_ok=True)
    rows: list[Probe] = []
    store = hostile.StoreProcess(workdir / "store", token=TOKEN)
    try:
        rows += _memory_probes(store)
        rows += _exposure_probes(workdir, store)
    finally:
        store.stop()
    rows.append(_guarded(TENANT_PROBE, lambda: _tenant_probe(workdir)))
    return rows


def format_table(rows: list[Probe]) -> str:
    width = max(len(r["probe"]) for r in rows)
    lines = [f"{'probe':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    for r in rows:
        lines.append(
            f"{r['probe']:<{width}}  {'pass' if r['passed'] else 'FAIL':<6}  {r['detail']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None, help="logs (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="store-probes-") as tmp:
        rows = run_store_probes(args.workdir or Path(tmp))
    print(format_table(rows))
    raise SystemExit(0 if all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
    main()
