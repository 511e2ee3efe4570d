"""One package per op; importing one registers the op and its implementations."""

from . import (
    concat_and_cache_mla,
    fused_qk_norm_rope,
    fused_qk_norm_rope_and_reshape_cache_flash,
    fused_rope_and_reshape_cache_flash,
    reshape_and_cache_flash,
    rotary_embedding,
)

__all__ = ["reshape_and_cache_flash", "rotary_embedding", "fused_rope_and_reshape_cache_flash",
           "concat_and_cache_mla", "fused_qk_norm_rope",
           "fused_qk_norm_rope_and_reshape_cache_flash"]
