"""Files and folders the launcher creates are this user's alone (issue 31, item 7)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from banaserve.migration.boundary_control import make_private_dir
from banaserve.utils.processes import open_private_log


def test_logs_are_created_readable_by_their_user_only(tmp_path: Path) -> None:
    log = tmp_path / "instance.log"
    with open_private_log(log) as out:
        out.write(b"server_args=... 'admin_api_key': 'secret'\n")
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    with open_private_log(log) as out:  # appends
        out.write(b"more\n")
    assert log.read_bytes().endswith(b"secret'\nmore\n")


def test_a_shared_place_folder_must_be_private(tmp_path: Path) -> None:
    mine = tmp_path / "split"
    make_private_dir(mine)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    make_private_dir(mine)  # again: still fine
    open_to_all = tmp_path / "made-by-someone-else"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    with pytest.raises(PermissionError, match="not a private folder"):
        make_private_dir(open_to_all)
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(PermissionError):
        make_private_dir(link)
