"""A running server's pipeline stage processes and the CPU masks of their threads."""

from __future__ import annotations

import contextlib
import os
import re

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
