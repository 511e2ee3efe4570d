"""kvwrite: writing new keys and values into a paged KV cache.

Ops live in :mod:`kvwrite.ops` (one package each), their implementations in the registry
(:func:`implementations`).
"""

import importlib.metadata

from . import registry
from .dtypes import CacheDType
from .layouts import KVAlloc, Layout, allocate_kv_cache, create_kv_caches_with_random_flash
from .ops.concat_and_cache_mla import MlaMode, concat_and_cache_mla, create_mla_cache
from .ops.cp_gather_and_upconvert_fp8_kv_cache import cp_gather_and_upconvert_fp8_kv_cache
from .ops.cp_gather_cache import cp_gather_cache
from .ops.cp_gather_indexer_k_quant_cache import cp_gather_indexer_k_quant_cache
from .ops.fused_qk_norm_rope import fused_qk_norm_rope
from .ops.fused_qk_norm_rope_and_reshape_cache_flash import (
    fused_qk_norm_rope_and_reshape_cache_flash,
)
from .ops.fused_rope_and_reshape_cache_flash import fused_rope_and_reshape_cache_flash
from .ops.gather_and_maybe_dequant_cache import gather_and_maybe_dequant_cache
from .ops.gather_cache_flash import gather_cache_flash
from .ops.indexer_k_quant_and_cache import create_indexer_k_cache, indexer_k_quant_and_cache
from .ops.nvfp4 import (
    nvfp4_gather_cache,
    nvfp4_kv_dequantize,
    nvfp4_kv_quantize,
    nvfp4_quantize_append_paged_kv_cache_with_slot_mapping,
)
from .ops.reshape_and_cache import create_legacy_kv_cache, reshape_and_cache
from .ops.reshape_and_cache_flash import check_slot_mapping, reshape_and_cache_flash
from .ops.reshape_and_cache_flash_per_token_head_quant import (
    PerTokenHeadMode,
    create_per_token_head_caches,
    dequantize_per_token_head,
    reshape_and_cache_flash_per_token_head_quant,
)
from .ops.rotary_embedding import check_positions, rotary_embedding
from .registry import implementations

try:  # pyproject.toml's version, as installed
    __version__ = importlib.metadata.version("kvwrite")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "unknown (not installed)"

__all__ = [
    "CacheDType",
    "KVAlloc",
    "Layout",
    "MlaMode",
    "allocate_kv_cache",
    "check_positions",
    "check_slot_mapping",
    "concat_and_cache_mla",
    "cp_gather_and_upconvert_fp8_kv_cache",
    "cp_gather_cache",
    "cp_gather_indexer_k_quant_cache",
    "create_mla_cache",
    "create_kv_caches_with_random_flash",
    "create_indexer_k_cache",
    "create_legacy_kv_cache",
    "fused_rope_and_reshape_cache_flash",
    "gather_and_maybe_dequant_cache",
    "gather_cache_flash",
    "fused_qk_norm_rope",
    "fused_qk_norm_rope_and_reshape_cache_flash",
    "implementations",
    "indexer_k_quant_and_cache",
    "nvfp4_gather_cache",
    "nvfp4_kv_dequantize",
    "nvfp4_kv_quantize",
    "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping",
    "registry",
    "reshape_and_cache",
    "reshape_and_cache_flash",
    "rotary_embedding",
    "PerTokenHeadMode",
    "create_per_token_head_caches",
    "dequantize_per_token_head",
    "reshape_and_cache_flash_per_token_head_quant",
]
