"""kvwrite: writing new keys and values into a paged KV cache.

Ops live in :mod:`kvwrite.ops` (one package each), their implementations in the registry
(:func:`implementations`).
"""

from . import registry
from .dtypes import CacheDType
from .layouts import KVAlloc, Layout, allocate_kv_cache, create_kv_caches_with_random_flash
from .ops.concat_and_cache_mla import MlaMode, concat_and_cache_mla, create_mla_cache
from .ops.fused_qk_norm_rope import fused_qk_norm_rope
from .ops.fused_qk_norm_rope_and_reshape_cache_flash import (
    fused_qk_norm_rope_and_reshape_cache_flash,
)
from .ops.fused_rope_and_reshape_cache_flash import fused_rope_and_reshape_cache_flash
from .ops.reshape_and_cache_flash import check_slot_mapping, reshape_and_cache_flash
from .ops.rotary_embedding import check_positions, rotary_embedding
from .registry import implementations

__version__ = "0.1.0"

__all__ = [
    "CacheDType",
    "KVAlloc",
    "Layout",
    "MlaMode",
    "allocate_kv_cache",
    "check_positions",
    "check_slot_mapping",
    "concat_and_cache_mla",
    "create_mla_cache",
    "create_kv_caches_with_random_flash",
    "fused_rope_and_reshape_cache_flash",
    "fused_qk_norm_rope",
    "fused_qk_norm_rope_and_reshape_cache_flash",
    "implementations",
    "registry",
    "reshape_and_cache_flash",
    "rotary_embedding",
]
