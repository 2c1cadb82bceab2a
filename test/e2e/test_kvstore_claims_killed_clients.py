"""Claims of a client process killed with SIGKILL end with its connection: while it holds them,
and while it is itself waiting in a LOOKUP. The server runs in process; the clients are real
processes because they must die for real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from banaserve.kvstore.client import KvStoreClient
from support.kvstore_claims import (
    Background,
    in_process_server,
    wait_until,
    waiting,
)
from support.kvstore_server import TOKEN, InProcessServer, keys_for

#: a fresh in-process store server for each test
server = pytest.fixture(in_process_server)

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


CLAIM_AND_HANG = """
import sys, time
from banaserve.kvstore.client import KvStoreClient
client = KvStoreClient(sys.argv[1], token=sys.argv[2])
keys = [bytes.fromhex(k) for k in sys.argv[3:]]
assert client.lookup(keys, owner="doomed", lease_s=60) == 0
print("claimed", flush=True)
time.sleep(600)
"""


def test_killed_claimant_process_releases_its_claims(server: InProcessServer) -> None:
    keys = keys_for("sigkill", 3)
    env = {**os.environ, "PYTHONPATH": str(PYTHON_DIR)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIM_AND_HANG, server.url, TOKEN, *(k.hex() for k in keys)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
        with KvStoreClient(server.url, token=TOKEN) as b:
            waiter = Background(lambda: b.lookup(keys, owner="B", wait_s=30))
            wait_until(waiting(server.url))
            killed_at = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            assert waiter.result() == 0
            assert waiter.finished is not None and waiter.finished - killed_at < 3
            assert b.release(keys, owner="B") == [True] * 3
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


CLAIM_THEN_WAIT = """
import sys, time
from banaserve.kvstore.client import KvStoreClient
client = KvStoreClient(sys.argv[1], token=sys.argv[2])
mine, theirs = bytes.fromhex(sys.argv[3]), bytes.fromhex(sys.argv[4])
assert client.lookup([mine], owner="doomed", lease_s=60) == 0
print("claimed", flush=True)
client.lookup([theirs], owner="doomed", wait_s=100)  # on the connection that claimed
"""


def test_killed_claimant_waiting_itself_releases_its_claims(server: InProcessServer) -> None:
    """The claimant dies while its (only) lookup connection is held in a wait: the server
    notices the close during the wait, not after it."""
    mine, theirs = keys_for("claimant that waits", 2)
    env = {**os.environ, "PYTHONPATH": str(PYTHON_DIR)}
    with KvStoreClient(server.url, token=TOKEN) as t, KvStoreClient(server.url, token=TOKEN) as b:
        assert t.lookup([theirs], owner="T") == 0
        proc = subprocess.Popen(
            [sys.executable, "-c", CLAIM_THEN_WAIT, server.url, TOKEN, mine.hex(), theirs.hex()],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
            wait_until(waiting(server.url))
            waiter = Background(lambda: b.lookup([mine], owner="B", wait_s=60))
            wait_until(waiting(server.url, 2))
            killed_at = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            assert waiter.result() == 0
            assert waiter.finished is not None and waiter.finished - killed_at < 3
            assert b.release([mine], owner="B") == [True]
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        assert t.release([theirs], owner="T") == [True]  # the dead one's wait took nothing
