"""reshape_and_cache (docs/ops/reshape_and_cache.md): write new key and value rows into the
legacy paged-attention layout, ``key_cache [num_blocks, H, D/x, block_size, x]`` and
``value_cache [num_blocks, H, D, block_size]``, with reshape_and_cache_flash's inputs, modes,
quantization, scales and slot rules.

- :mod:`.op`: the public function, its validation, its torch.compile custom op,
  :func:`logical_views` and :func:`create_legacy_kv_cache`;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher;
- :mod:`.sanitize`: bounds-stressing cases for the memory checker.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import OP, create_legacy_kv_cache, logical_views, reshape_and_cache, validate

__all__ = ["OP", "create_legacy_kv_cache", "logical_views", "reshape_and_cache", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature="run(key, value, key_cache, value_cache, slot_mapping, cache_dtype: CacheDType, "
                  "k_scale, v_scale) -> None",
    unsupported_signature="unsupported(key, key_cache, cache_dtype: CacheDType, k_scale) "
                          "-> str | None",
    bench=registry.BenchCommand(
        "reshape_and_cache", "kvwrite.bench.ops.reshape_and_cache:BENCH",
        "the legacy paged-attention cache write (x-packed key layout)", aliases=("legacy",)),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch (index_put_ through permuted views, padding and bounds masked); "
                "the reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
    # Boolean masking of padding/out-of-range slots syncs with the host.
    graph_safe=False,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel, every cache dtype, per-head scales, any cache strides",
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
