"""fused_qk_norm_rope_and_reshape_cache_flash (docs/ops/fused_qk_norm_rope.md): QK-norm and RoPE
of the packed qkv's query and key heads, then the key and value heads written into the paged KV
cache, in one call (the query in place, or to query_out, plain or fp8).

- :mod:`.op`: the public function, its validation and its torch.compile custom op;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle: the unfused
  sequence);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher;
- :mod:`.sanitize`: bounds-stressing cases for the memory checker.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import OP, fused_qk_norm_rope_and_reshape_cache_flash, validate

__all__ = ["OP", "fused_qk_norm_rope_and_reshape_cache_flash", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature="run(qkv [T_pad, Hq+Hk+Hv, D], num_heads_q, num_heads_k, eps: float, q_weight, "
                  "k_weight, cos_sin_cache, is_neox, position_ids, weight_offset: float, "
                  "key_cache, value_cache, slot_mapping, cache_dtype: CacheDType, k_scale, "
                  "v_scale, rotate_key_in_place: bool, query_out [T_pad, Hq, D] | None, "
                  "q_scale | None) -> None",
    unsupported_signature="unsupported(qkv, q_weight, k_weight, cos_sin_cache, is_neox, "
                          "key_cache, cache_dtype: CacheDType, query_out) -> str | None",
    bench=registry.BenchCommand(
        "fused_qk_norm_rope_and_reshape_cache_flash", "kvwrite.bench.ops.fused_qk_norm_rope_and_reshape_cache_flash:BENCH",
        "QK-norm + RoPE + cache write: fused, the unfused sequence, norm+rope alone", aliases=("qk-norm-rope",)),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch: fused_qk_norm_rope's reference, then the cache write's; the "
                "reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
    # The cache write's boolean masking syncs with the host.
    graph_safe=False,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel: norm, rotation, query/key stores and cache write in one launch",
    module=f"{__name__}.triton_impl",
    priority=10,
    requires=("triton",),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="cuda",
    description="CUDA C++ kernel compiled at run time with NVRTC (cuda.core), a lane group per "
                "head",
    module=f"{__name__}.cuda_impl",
    priority=20,
))
