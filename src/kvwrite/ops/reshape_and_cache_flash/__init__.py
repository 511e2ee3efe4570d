"""reshape_and_cache_flash (docs/ops/reshape_and_cache_flash.md): write new key and value rows into
a paged KV cache.

- :mod:`.op`: the public function, its validation, its torch.compile custom op, and
  ``check_slot_mapping``;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import OP, check_slot_mapping, reshape_and_cache_flash, validate

__all__ = ["OP", "reshape_and_cache_flash", "check_slot_mapping", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature="run(key, value, key_cache, value_cache, slot_mapping, cache_dtype: CacheDType, "
                  "k_scale, v_scale) -> None",
    unsupported_signature="unsupported(key, key_cache, cache_dtype: CacheDType, k_scale, "
                          "v_scale) -> str | None",
    bench=registry.BenchCommand(
        "reshape_and_cache_flash", "kvwrite.bench.ops.reshape_and_cache_flash:BENCH",
        "the KV cache write: vLLM's benchmark (also the default: kvwrite-bench [flags])"),
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
    description="Triton kernel, every layout and fp8 mode",
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

from . import peers  # noqa: E402, F401  (registers the peers: torch-compile, vllm, vllm-triton, flashinfer)
