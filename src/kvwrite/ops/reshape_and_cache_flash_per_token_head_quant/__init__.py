"""reshape_and_cache_flash_per_token_head_quant: quantize each (token, KV head) row of key and
value with its own scale, computed while writing, into a paged cache (int8, fp8 or int4, the
scale stored beside the row), and the allocator and reader of such caches.

- :mod:`.op`: the public function, the mode enum, its validation and its torch.compile custom op;
- :mod:`.caches`: :func:`create_per_token_head_caches` and :func:`dequantize_per_token_head`;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher;
- :mod:`.sanitize`: bounds-stressing cases for the memory checker.

Importing this package registers the op and its three implementations. The contract:
docs/ops/reshape_and_cache_flash_per_token_head_quant.md.
"""

from ... import registry
from .caches import create_per_token_head_caches, dequantize_per_token_head, parse_kv_alloc
from .op import (
    OP,
    SCALE_FLOOR,
    SCALE_FLOOR_BITS,
    PerTokenHeadMode,
    parse_kv_quant_mode,
    reshape_and_cache_flash_per_token_head_quant,
    validate,
)

__all__ = ["OP", "PerTokenHeadMode", "SCALE_FLOOR", "SCALE_FLOOR_BITS",
           "create_per_token_head_caches", "dequantize_per_token_head", "parse_kv_alloc",
           "parse_kv_quant_mode", "reshape_and_cache_flash_per_token_head_quant", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature=("run(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, "
                   "slot_mapping, mode: PerTokenHeadMode) -> None"),
    unsupported_signature=("unsupported(key, value, key_cache, value_cache, "
                           "mode: PerTokenHeadMode) -> str | None"),
    bench=registry.BenchCommand(
        "reshape_and_cache_flash_per_token_head_quant", "kvwrite.bench.ops.per_token_head:BENCH",
        "the per-(token, head) quantized cache write: int8, fp8, int4", aliases=("per-token-head",)),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch (row reductions, exact roundings, index_put_); the reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
    # Boolean masking of padding/out-of-range slots syncs with the host.
    graph_safe=False,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel, the three modes (row reductions in the tile)",
    module=f"{__name__}.triton_impl",
    priority=10,
    requires=("triton",),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="cuda",
    description="CUDA C++ kernel compiled at run time with NVRTC (cuda.core), a lane group per row",
    module=f"{__name__}.cuda_impl",
    priority=20,
))
