"""``ucx://``: reserved for a UCX data plane (the optional extra ``banaserve[ucx]``).

Not implemented in this build: with ucxx missing the error says which extra to install, and
with ucxx present it says that the transport is not there yet, so ``tcp://``/``shm://`` apply.
"""

from __future__ import annotations

from banaserve.kvstore.transport.base import Address, KvStoreError, Transport

UCX_EXTRA_HINT = "ucx:// needs the optional extra banaserve[ucx] (pip install 'banaserve[ucx]')"


def open_ucx(address: Address, timeout: float) -> Transport:
    """Raises KvStoreError: see the module docstring."""
    try:
        import ucxx  # noqa: F401
    except ImportError as exc:
        raise KvStoreError(f"{address.url}: {UCX_EXTRA_HINT}; use tcp:// or shm://") from exc
    raise KvStoreError(
        f"{address.url}: the ucx:// transport is not implemented yet; use tcp:// or shm://"
    )
