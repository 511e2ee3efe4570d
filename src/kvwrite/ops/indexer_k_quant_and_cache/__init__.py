"""indexer_k_quant_and_cache (docs/ops/indexer_k_quant_and_cache.md): quantize DeepSeek-V3.2's
lightning-indexer keys into e4m3 codes with per-group scales (4 bytes: a float32, or "mxfp8"'s
UE8M0 exponent byte 4 times), into a paged cache whose page holds all codes, then all scales.

- :mod:`.op`: the public function, its validation, its torch.compile custom op, the scale-format
  enum and :func:`create_indexer_k_cache`;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher;
- :mod:`.sanitize`: bounds-stressing cases for the memory checker.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import (
    OP,
    ScaleFormat,
    create_indexer_k_cache,
    entry_size,
    indexer_k_quant_and_cache,
    parse_scale_fmt,
    validate,
)

__all__ = ["OP", "ScaleFormat", "create_indexer_k_cache", "entry_size",
           "indexer_k_quant_and_cache", "parse_scale_fmt", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature="run(k, kv_cache, slot_mapping, quant_block_size: int, fmt: ScaleFormat) "
                  "-> None",
    unsupported_signature="unsupported(k, kv_cache, fmt: ScaleFormat) -> str | None",
    bench=registry.BenchCommand(
        "indexer_k_quant_and_cache", "kvwrite.bench.ops.indexer:BENCH",
        "DeepSeek-V3.2's indexer key write (e4m3 codes + group scales)", aliases=("indexer",)),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch (index_put_ with padding and bounds masked); the reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
    # Boolean masking of padding/out-of-range slots syncs with the host.
    graph_safe=False,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel (group amax, scales and codes in the kernel)",
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
