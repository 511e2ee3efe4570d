"""fused_rope_and_reshape_cache_flash (docs/ops/fused_rope_and_reshape_cache_flash.md): RoPE on
query and key, then the key and value rows written into the paged KV cache, in one call."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs="the cache write's boolean masking",
    run="query, key, value, positions, cos_sin_cache, is_neox, key_cache, value_cache, "
        "slot_mapping, cache_dtype: CacheDType, k_scale, v_scale, rotate_key_in_place: bool, "
        "query_out | None",
    unsupported="query, key, key_cache, cache_dtype: CacheDType, cos_sin_cache, is_neox",
    torch=": the rotation's reference, then the cache write's",
    triton=": rotation, query/key stores and cache write in one launch",
    bench=registry.bench("fused_rope_and_reshape_cache_flash", "RoPE + cache write, fused, "
                         "against the unfused pair and rotary_embedding alone", aliases=("rope",)))
