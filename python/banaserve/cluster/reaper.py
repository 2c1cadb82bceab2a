"""The launcher's reaper: cleans up after the launcher however it ends, SIGKILL included.

``python -m banaserve.cluster.reaper LEDGER`` runs in a session of its own and blocks reading
its stdin, a pipe whose write end only the launcher holds. When the launcher exits for any
reason the pipe closes, and the reaper runs :func:`~banaserve.cluster.leftovers.clean_up`
on the ledger: every process still alive in the children's sessions is killed and the shm
files they mapped are removed. The children also have PDEATHSIG set, so they are usually
gone already; the reaper catches what escaped (grandchildren, files).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from banaserve.utils.processes import open_private_log


class Reaper:
    """The reaper process, owned by the launcher: :meth:`stop` (a clean exit) makes it clean
    up and exit at once; if the launcher dies first, it does so by itself."""

    def __init__(self, ledger: Path, log_path: Path) -> None:
        with open_private_log(log_path) as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "banaserve.cluster.reaper", str(ledger)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # a signal to the launcher's group must not reach it
            )  # fmt: skip

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main(argv: list[str]) -> None:
    from banaserve.cluster.leftovers import clean_up

    ledger = Path(argv[0])
    sys.stdin.buffer.read()  # returns when the launcher's end of the pipe closes
    killed, removed = clean_up(ledger)
    print(f"[banaserve reaper] killed {killed} processes, removed {removed} shm files",
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
