"""One package per op; importing one registers the op and its implementations.

Each package holds :mod:`.op` (the public function, its validation and, through
:func:`kvwrite.registry.custom_op`, the custom op torch.compile sees), the three implementations
:func:`kvwrite.registry.define_op` finds by module name (``reference``: plain PyTorch, the oracle;
``triton_impl``; ``cuda_impl`` with its ``kernel.cu``), and its ``__init__``: the op's declaration.
"""

from . import (  # noqa: E402
    concat_and_cache_mla,
    cp_gather_and_upconvert_fp8_kv_cache,
    cp_gather_cache,
    cp_gather_indexer_k_quant_cache,
    fused_qk_norm_rope,
    fused_qk_norm_rope_and_reshape_cache_flash,
    fused_rope_and_reshape_cache_flash,
    gather_and_maybe_dequant_cache,
    gather_cache_flash,
    indexer_k_quant_and_cache,
    mx_kv_write,
    nvfp4,
    pack_kv_pages,
    relayout_kv_cache,
    reshape_and_cache,
    reshape_and_cache_flash,
    reshape_and_cache_flash_per_token_head_quant,
    reshape_and_cache_turboquant,
    rotary_embedding,
    swap_blocks,
    swap_blocks_multi_layer,
    unpack_kv_pages,
)

__all__ = ["reshape_and_cache_flash", "rotary_embedding", "fused_rope_and_reshape_cache_flash",
           "concat_and_cache_mla", "indexer_k_quant_and_cache", "reshape_and_cache", "nvfp4", "mx_kv_write",
           "reshape_and_cache_flash_per_token_head_quant", "gather_and_maybe_dequant_cache",
           "cp_gather_cache", "cp_gather_and_upconvert_fp8_kv_cache", "gather_cache_flash",
           "cp_gather_indexer_k_quant_cache", "fused_qk_norm_rope",
           "fused_qk_norm_rope_and_reshape_cache_flash", "swap_blocks", "swap_blocks_multi_layer",
           "relayout_kv_cache", "pack_kv_pages", "unpack_kv_pages",
           "reshape_and_cache_turboquant"]
