"""fused_qk_norm_rope_and_reshape_cache_flash (docs/ops/fused_qk_norm_rope.md): QK-norm and RoPE
of the packed qkv's query and key heads, then the key and value heads written into the cache."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs="the cache write's boolean masking",
    run="qkv [T_pad, Hq+Hk+Hv, D], num_heads_q, num_heads_k, eps: float, q_weight, k_weight, "
        "cos_sin_cache, is_neox, position_ids, weight_offset: float, key_cache, value_cache, "
        "slot_mapping, cache_dtype: CacheDType, k_scale, v_scale, rotate_key_in_place: bool, "
        "query_out [T_pad, Hq, D] | None, q_scale | None",
    unsupported="qkv, q_weight, k_weight, cos_sin_cache, is_neox, key_cache, "
                "cache_dtype: CacheDType, query_out",
    torch=": fused_qk_norm_rope's reference, then the cache write's", cuda=", a lane group per head",
    triton=": norm, rotation, query/key stores and cache write in one launch",
    bench=registry.bench("fused_qk_norm_rope_and_reshape_cache_flash", "QK-norm + RoPE + cache "
                         "write: fused, the unfused sequence, norm+rope alone", aliases=("qk-norm-rope",)))
