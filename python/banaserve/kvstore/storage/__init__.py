"""Page storage tiers of the KV store: RAM (LRU), SSD (verified page files), and both."""

from .base import PageStore, StoreStats
from .memory import MemoryStore
from .ssd import SsdStore
from .tiered import TieredStore

__all__ = ["PageStore", "StoreStats", "MemoryStore", "SsdStore", "TieredStore"]
