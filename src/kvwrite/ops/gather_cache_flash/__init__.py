"""gather_cache_flash (docs/ops/gather.md): gather the key and value rows of a batch of sequences
out of paged caches in every layout (NHD, HND, interleaved, packed) and format (copies, fp8 with
per-tensor or per-head scales): the read side of reshape_and_cache_flash.

- :mod:`.op`: the public function, its validation and its torch.compile custom op;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher;
- :mod:`.sanitize`: bounds-stressing cases for compute-sanitizer.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import OP, gather_cache_flash, validate

__all__ = ["OP", "gather_cache_flash", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature=("run(key_cache, value_cache, key_out, value_out, block_table, cu_seq_lens, "
                   "seq_starts, cache_dtype: CacheDType, k_scale, v_scale) -> None"),
    unsupported_signature="unsupported(key_cache, key_out, cache_dtype: CacheDType) -> str | None",
    bench=registry.BenchCommand(
        "gather", "kvwrite.bench.ops.gather:BENCH",
        "reading caches back: the five gathers (dequant, cp, upconvert, flash, indexer)"),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch (the row rule by repeat_interleave, index_put_); the reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
    # The row count of the rule syncs with the host.
    graph_safe=False,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel, every layout and format (exact fp8 decode, per-head scales)",
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
