"""NVFP4 KV cache writes and readers (docs/ops/nvfp4.md): 4-bit E2M1 codes with an E4M3 scale per
16 elements and a float32 scale per tensor.

- :mod:`.rule`: the group rule in plain PyTorch (the reference of every implementation);
- :mod:`.op`: validation and dispatch of ``reshape_and_cache_flash(..., "nvfp4" |
  "nvfp4_4over6")`` (vLLM's page layout) and of
  :func:`nvfp4_quantize_append_paged_kv_cache_with_slot_mapping` (FlashInfer's separate tensors),
  both through one internal op, :data:`OP`;
- :mod:`.reference`, :mod:`.triton_impl`, :mod:`.cuda_impl` (+ ``kernel.cu``): its three
  implementations;
- :mod:`.readers`: :func:`nvfp4_gather_cache`, :func:`nvfp4_kv_quantize`,
  :func:`nvfp4_kv_dequantize`;
- :mod:`.sanitize`: bounds-stressing cases for compute-sanitizer.

Importing this package registers the internal op and its three implementations.
"""

from ... import registry
from .op import (
    OP,
    ScaleLayout,
    append_run_args,
    default_v_scale_layout,
    flash_run_args,
    nvfp4_quantize_append_paged_kv_cache_with_slot_mapping,
    page_bytes,
    parse_scale_layout,
    select_implementation,
    write_flash,
)
from .readers import nvfp4_gather_cache, nvfp4_kv_dequantize, nvfp4_kv_quantize

__all__ = ["OP", "ScaleLayout", "append_run_args", "default_v_scale_layout", "flash_run_args",
           "nvfp4_gather_cache", "nvfp4_kv_dequantize", "nvfp4_kv_quantize",
           "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping", "page_bytes",
           "parse_scale_layout", "select_implementation", "write_flash"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature="run(key, value, k_data, k_sf, v_data, v_sf, slot_mapping, "
                  "cache_dtype: CacheDType, k_scale, v_scale, v_scale_layout: ScaleLayout) -> None",
    unsupported_signature="unsupported(key, k_data, cache_dtype: CacheDType, "
                          "v_scale_layout: ScaleLayout) -> str | None",
    bench=registry.BenchCommand(
        "nvfp4", "kvwrite.bench.ops.nvfp4:BENCH",
        "the NVFP4 cache write (vLLM's page layout), beside the fp8 write of the same shape"),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch (the group rule on float32 tensors, index_put_); the reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
    # Boolean masking of padding/out-of-range slots syncs with the host.
    graph_safe=False,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel, both rules, every layout",
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
