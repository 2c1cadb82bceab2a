"""SGLang's torch.distributed rendezvous through a file in a private folder, not a TCP port.

SGLang's default rendezvous (``tcp://HOST:PORT``) starts torch's ``TCPStore`` in rank 0,
and that listens on every address of the machine whatever ``--host`` says (issue 31 found
one ``:::PORT`` per instance). A ``FileStore`` in a folder only this user can enter binds
nothing, so it replaces the TCP store wherever every rank of the server runs on this host.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

from banaserve.env import RENDEZVOUS_ENV

#: Where SGLang's CPU all-reduce (AMX and arm64 only) takes the names of its shared-memory
#: segments from; SGLang fills them from a ``tcp://`` rendezvous only.
_SHM_NAME_ENVS = ("MASTER_ADDR", "MASTER_PORT")
_PREFIX = "banaserve-rendezvous-"


def needs_private_rendezvous(nnodes: int, dist_init_addr: str | None) -> bool:
    """Whether the server's ranks meet on this host through SGLang's default TCP store: not
    when the user chose the rendezvous (``--dist-init-addr``, or the environment) or ranks
    run on several hosts (``--nnodes``)."""
    return nnodes == 1 and not dist_init_addr and not os.environ.get(RENDEZVOUS_ENV)


class PrivateRendezvous:
    """A folder of mode 0700 holding the rendezvous file of one server run, named in this
    process's environment (which its scheduler processes inherit) until :meth:`remove`.

    Each run gets a new folder, named after its process: torch's ``FileStore`` must not
    meet a file a killed run left behind, and a server killed before :meth:`remove` (SGLang
    ends with SIGKILL to its own tree) leaves its folder for the next run to remove.
    """

    def __init__(self, port: int) -> None:
        remove_dead_runs(Path(tempfile.gettempdir()))
        self.folder = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
        os.environ[RENDEZVOUS_ENV] = f"file://{self.folder / 'store'}"
        # Distinct segment names for co-located servers, as SGLang derives them from TCP.
        os.environ.setdefault(_SHM_NAME_ENVS[0], "127.0.0.1")
        os.environ.setdefault(_SHM_NAME_ENVS[1], str(port))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def remove_dead_runs(parent: Path) -> list[Path]:
    """Remove the rendezvous folders in ``parent`` that this user's processes, now gone, left
    behind; return them. A folder whose process still runs, or another user's, stays."""
    removed = []
    for folder in parent.glob(f"{_PREFIX}*-*"):
        pid = folder.name[len(_PREFIX) :].split("-", 1)[0]
        with contextlib.suppress(OSError):
            info = folder.lstat()
            if not (pid.isdigit() and stat.S_ISDIR(info.st_mode)) or info.st_uid != os.getuid():
                continue
            if not _alive(int(pid)):
                shutil.rmtree(folder)
                removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not yet reaped) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")
