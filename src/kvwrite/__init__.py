"""kvwrite: writing new keys and values into a paged KV cache.

Ops live in :mod:`kvwrite.ops` (one package each), their implementations in the registry
(:func:`implementations`).

Importing kvwrite imports nothing else (not even PyTorch): the first public name used imports
every op (registering them and their implementations) and then the name's module. So
``kvwrite-bench --version`` answers at once, and Ctrl-C while PyTorch loads is the CLI's one line.
"""

import importlib
import importlib.metadata

# Each public name and the module (relative to this package) that defines it.
_EXPORTS = {
    "CacheDType": ".dtypes",
    "KVAlloc": ".layouts",
    "Layout": ".layouts",
    "allocate_kv_cache": ".layouts",
    "create_kv_caches_with_random_flash": ".layouts",
    "MlaMode": ".ops.concat_and_cache_mla",
    "concat_and_cache_mla": ".ops.concat_and_cache_mla",
    "create_mla_cache": ".ops.concat_and_cache_mla",
    "cp_gather_and_upconvert_fp8_kv_cache": ".ops.cp_gather_and_upconvert_fp8_kv_cache",
    "cp_gather_cache": ".ops.cp_gather_cache",
    "cp_gather_indexer_k_quant_cache": ".ops.cp_gather_indexer_k_quant_cache",
    "fused_qk_norm_rope": ".ops.fused_qk_norm_rope",
    "fused_qk_norm_rope_and_reshape_cache_flash": ".ops.fused_qk_norm_rope_and_reshape_cache_flash",
    "fused_rope_and_reshape_cache_flash": ".ops.fused_rope_and_reshape_cache_flash",
    "gather_and_maybe_dequant_cache": ".ops.gather_and_maybe_dequant_cache",
    "gather_cache_flash": ".ops.gather_cache_flash",
    "create_indexer_k_cache": ".ops.indexer_k_quant_and_cache",
    "indexer_k_quant_and_cache": ".ops.indexer_k_quant_and_cache",
    "mx_gather_cache": ".ops.mx_kv_write",
    "nvfp4_gather_cache": ".ops.nvfp4",
    "nvfp4_kv_dequantize": ".ops.nvfp4",
    "nvfp4_kv_quantize": ".ops.nvfp4",
    "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping": ".ops.nvfp4",
    "create_legacy_kv_cache": ".ops.reshape_and_cache",
    "reshape_and_cache": ".ops.reshape_and_cache",
    "check_slot_mapping": ".ops.reshape_and_cache_flash",
    "reshape_and_cache_flash": ".ops.reshape_and_cache_flash",
    "PerTokenHeadMode": ".ops.reshape_and_cache_flash_per_token_head_quant",
    "create_per_token_head_caches": ".ops.reshape_and_cache_flash_per_token_head_quant",
    "dequantize_per_token_head": ".ops.reshape_and_cache_flash_per_token_head_quant",
    "reshape_and_cache_flash_per_token_head_quant": ".ops.reshape_and_cache_flash_per_token_head_quant",
    "reshape_and_cache_turboquant": ".ops.reshape_and_cache_turboquant",
    "turboquant_store": ".ops.reshape_and_cache_turboquant",
    "turboquant_gather_cache": ".ops.reshape_and_cache_turboquant",
    "turboquant_layout": ".ops.reshape_and_cache_turboquant",
    "turboquant_tables": ".ops.reshape_and_cache_turboquant",
    "TurboQuantLayout": ".formats",
    "check_positions": ".ops.rotary_embedding",
    "rotary_embedding": ".ops.rotary_embedding",
    "implementations": ".registry",
    "swap_blocks": ".ops.swap_blocks",
    "swap_blocks_multi_layer": ".ops.swap_blocks_multi_layer",
    "relayout_kv_cache": ".ops.relayout_kv_cache",
    "pack_kv_pages": ".ops.pack_kv_pages",
    "unpack_kv_pages": ".ops.unpack_kv_pages",
    "kv_page_bytes": ".transfer",
    # Submodules, as attributes.
    "ops": ".ops",
    "registry": ".registry",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module(".ops", __name__)  # every op and implementation registered first
    value = importlib.import_module(module, __name__)
    if name not in ("ops", "registry"):
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


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
    "mx_gather_cache",
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
    "reshape_and_cache_turboquant",
    "turboquant_store",
    "turboquant_gather_cache",
    "turboquant_layout",
    "turboquant_tables",
    "TurboQuantLayout",
    "swap_blocks",
    "swap_blocks_multi_layer",
    "relayout_kv_cache",
    "pack_kv_pages",
    "unpack_kv_pages",
    "kv_page_bytes",
]
