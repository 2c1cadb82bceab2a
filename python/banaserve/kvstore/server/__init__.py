"""The KV store server: one :class:`PageStore` per process, served over tcp://, shm:// and
ucx://.

:mod:`.ops` answers every request (one handler per operation, and :class:`ServerConfig`);
:mod:`.tcp` (:class:`KvStoreServer`) and :mod:`.ucx` (:func:`~.ucx.start_ucx_listener`) only
read frames and send replies; :mod:`.cli` is ``python -m banaserve.kvstore.server``.
"""

from __future__ import annotations

from banaserve.kvstore.server.ops import ServerConfig
from banaserve.kvstore.server.shm import SHM_CHUNK_BYTES
from banaserve.kvstore.server.tcp import KvStoreServer

__all__ = ["SHM_CHUNK_BYTES", "KvStoreServer", "ServerConfig"]
