"""A running server's pipeline stage processes and the CPU masks of their threads."""

from __future__ import annotations

import contextlib
import os
import re
import socket

import psutil


def stage_processes(server_pid: int) -> dict[int, psutil.Process]:
    """The stage processes under ``server_pid`` by pipeline rank (SGLang titles them
    ``sglang::scheduler_PP<rank>``)."""
    stages = {}
    for child in psutil.Process(server_pid).children(recursive=True):
        match = re.match(r"sglang::scheduler_PP(\d)", " ".join(child.cmdline()))
        if match:
            stages[int(match.group(1))] = child
    return stages


def thread_masks(process: psutil.Process) -> set[frozenset[int]]:
    """The distinct CPU affinity masks of ``process``'s threads."""
    masks = set()
    for thread in process.threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            masks.add(frozenset(os.sched_getaffinity(thread.id)))
    return masks


def listening_sockets(root_pid: int) -> dict[str, set[str]]:
    """Every socket listening for the network (TCP in LISTEN, bound UDP) in ``root_pid``'s
    process tree, by ``name(pid)``, as ``address:port``."""
    found: dict[str, set[str]] = {}
    root = psutil.Process(root_pid)
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for sock in process.net_connections(kind="inet"):
                listens = sock.status == psutil.CONN_LISTEN or (
                    sock.type == socket.SOCK_DGRAM and sock.laddr
                )
                if listens:
                    name = f"{process.name()}({process.pid})"
                    found.setdefault(name, set()).add(f"{sock.laddr.ip}:{sock.laddr.port}")
    return found


def not_on_loopback(listeners: dict[str, set[str]]) -> dict[str, set[str]]:
    """The listeners of :func:`listening_sockets` bound to anything but 127.0.0.1."""
    wide = {name: {a for a in addresses if not a.startswith("127.0.0.1:")}
            for name, addresses in listeners.items()}  # fmt: skip
    return {name: addresses for name, addresses in wide.items() if addresses}
