"""kvwrite: writing new keys and values into a paged KV cache (``reshape_and_cache_flash``)."""

from .dtypes import CacheDType
from .layouts import KVAlloc, Layout, allocate_kv_cache, create_kv_caches_with_random_flash
from .op import check_slot_mapping, reshape_and_cache_flash
from .registry import implementations

__version__ = "0.1.0"

__all__ = [
    "CacheDType",
    "KVAlloc",
    "Layout",
    "allocate_kv_cache",
    "check_slot_mapping",
    "create_kv_caches_with_random_flash",
    "implementations",
    "reshape_and_cache_flash",
]
