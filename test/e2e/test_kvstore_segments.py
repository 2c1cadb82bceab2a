"""The shm:// segments: a server's and a client's process sharing one resource tracker (as a
cluster's do) map, unlink and free a segment without a traceback, and leave no name behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import banaserve

# The store server's side in the parent, a client's in a spawned child: both use the parent's
# resource tracker, as launch_server's store and instances do.
SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp
    import os
    from multiprocessing import resource_tracker

    from banaserve.kvstore.segments import create_segment, destroy_segment, open_segment


    def client(name, size):
        segment = open_segment(name, size)
        segment.buf[0] = 7
        destroy_segment(segment)


    if __name__ == "__main__":
        resource_tracker.ensure_running()
        mp.set_start_method("spawn")
        segment = create_segment(4096)
        child = mp.Process(target=client, args=(segment.name, 4096))
        child.start()
        child.join()
        assert child.exitcode == 0, child.exitcode
        assert segment.buf[0] == 7
        destroy_segment(segment)
        print(segment.name)
    """
)


def test_a_shared_segment_ends_without_a_tracker_traceback(tmp_path: Path) -> None:
    script = tmp_path / "segment_users.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(banaserve.__file__).parents[1])}
    # Exiting also stops the tracker, which is when it reports what it was left holding.
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "leaked" not in done.stderr, done.stderr
    name = done.stdout.strip()
    assert name.startswith("bkv_")
    assert not Path("/dev/shm", name).exists()
