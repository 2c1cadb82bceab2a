"""Write a model folder so that readers only ever see nothing or a complete folder.

Contract: ``atomic_output_dir(out)`` yields a fresh empty sibling directory
``<out>.tmp-<pid>``; when the ``with`` body returns normally it is renamed onto ``out``
(``rename`` is atomic within one filesystem, which a sibling guarantees). If the body
raises, the temporary directory is removed and ``out`` is untouched. A process killed in
the middle leaves only a ``.tmp-<pid>`` folder, which the next writer of the same ``out``
deletes once that pid is gone. Concurrent writers of the same ``out`` are not coordinated
here: callers that may race take a lock (see ``banaserve.models.cache``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


class OutputExistsError(FileExistsError):
    """``out`` exists and is not an empty directory, and overwriting was not asked for."""


def check_output_dir(out: Path, force: bool) -> None:
    """Raise ``OutputExistsError`` unless ``out`` may be (over)written.

    Callers run this before any slow work so that a user mistake fails in milliseconds.
    """
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory; remove it first")
    if any(out.iterdir()) and not force:
        raise OutputExistsError(
            f"{out} exists and is not empty; pass --force to replace it, or choose another path"
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(out: Path) -> None:
    """Delete ``<out>.tmp-<pid>`` / ``<out>.old-<pid>`` siblings left by dead processes."""
    if not out.parent.is_dir():
        return
    for sibling in out.parent.iterdir():
        for marker in (".tmp-", ".old-"):
            prefix = out.name + marker
            if not sibling.name.startswith(prefix):
                continue
            pid_text = sibling.name[len(prefix) :]
            if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                shutil.rmtree(sibling, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces ``out`` on success.

    Raises ``OutputExistsError`` (before yielding) if ``out`` is a non-empty directory
    and ``force`` is false.
    """
    out = Path(out).absolute()
    check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # our own pid: leftover of an earlier failure
    tmp.mkdir()
    try:
        yield tmp
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(new: Path, out: Path) -> None:
    if out.is_dir() and any(out.iterdir()):
        # Two renames leave a short window with no ``out``, but never a partial one.
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(new, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if out.is_dir():
            out.rmdir()
        os.rename(new, out)
