"""``python -m banaserve.kvstore.ucx_server``: a RAM store over ucx:// only (tests, benchmarks).

The listener itself is :mod:`banaserve.kvstore.server.ucx`; its names stay importable here.
"""

from __future__ import annotations

from banaserve.kvstore.server.ucx import UcxListenerHandle, start_ucx_listener

__all__ = ["UcxListenerHandle", "start_ucx_listener"]

if __name__ == "__main__":
    from banaserve.kvstore.server.cli import ucx_main

    ucx_main()
