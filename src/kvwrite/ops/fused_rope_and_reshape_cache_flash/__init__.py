"""fused_rope_and_reshape_cache_flash (docs/ops/fused_rope_and_reshape_cache_flash.md): RoPE on
query and key, then the key and value rows written into the paged KV cache, in one call.

- :mod:`.op`: the public function, its validation and its torch.compile custom op;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle: the unfused pair);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import OP, fused_rope_and_reshape_cache_flash, validate

__all__ = ["OP", "fused_rope_and_reshape_cache_flash", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature="run(query, key, value, positions, cos_sin_cache, is_neox, key_cache, "
                  "value_cache, slot_mapping, cache_dtype: CacheDType, k_scale, v_scale, "
                  "rotate_key_in_place: bool, query_out | None) -> None",
    unsupported_signature="unsupported(query, key, key_cache, cache_dtype: CacheDType, "
                          "cos_sin_cache, is_neox) -> str | None",
    bench=registry.BenchCommand(
        "fused_rope_and_reshape_cache_flash", "kvwrite.bench.ops.fused_rope_and_reshape_cache_flash:BENCH",
        "RoPE + cache write, fused, against the unfused pair and rotary_embedding alone", aliases=("rope",)),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch: the rotation's reference, then the cache write's; the reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
    # The cache write's boolean masking syncs with the host.
    graph_safe=False,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel: rotation, query/key stores and cache write in one launch",
    module=f"{__name__}.triton_impl",
    priority=10,
    requires=("triton",),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="cuda",
    description="CUDA C++ kernel compiled at run time with NVRTC (cuda.core)",
    module=f"{__name__}.cuda_impl",
    priority=20,
))
