"""concat_and_cache_mla (docs/ops/concat_and_cache_mla.md): write one MLA latent row (kv_c then
k_pe) per token into a paged cache, plainly, as per-tensor fp8, or in DeepSeek's tiled fp8_ds_mla
format.

- :mod:`.op`: the public function, its validation, its torch.compile custom op, the mode enum
  and :func:`create_mla_cache`;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernels (NVRTC) and their launcher.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import (
    OP,
    DsMlaScale,
    MlaMode,
    concat_and_cache_mla,
    create_mla_cache,
    entry_size,
    parse_mla_mode,
    validate,
)

__all__ = ["OP", "DsMlaScale", "MlaMode", "concat_and_cache_mla", "create_mla_cache", "entry_size",
           "parse_mla_mode", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature=("run(kv_c, k_pe, kv_cache, slot_mapping, mode: MlaMode, scale, *, "
                   "ds_scale: DsMlaScale) -> None"),
    unsupported_signature="unsupported(kv_c, kv_cache, mode: MlaMode) -> str | None",
    bench=registry.BenchCommand(
        "concat_and_cache_mla", "kvwrite.bench.ops.concat_and_cache_mla:BENCH",
        "the MLA latent cache write (auto, fp8, fp8_ds_mla): vLLM's benchmark", aliases=("mla",)),
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
    description="Triton kernel, every mode (fp8_ds_mla tile scales in the kernel)",
    module=f"{__name__}.triton_impl",
    priority=10,
    requires=("triton",),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="cuda",
    description="CUDA C++ kernels compiled at run time with NVRTC (cuda.core)",
    module=f"{__name__}.cuda_impl",
    priority=20,
))
