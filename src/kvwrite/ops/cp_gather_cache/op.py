"""cp_gather_cache: the public op, its validation and its torch.compile custom op
(docs/ops/gather.md)."""

from __future__ import annotations

import torch

from ... import registry
from ...gather import check_index, check_requests
from ...validation import check_count, check_like, check_mutation_safe, require_tensor
from ...validation import shape_str as _shape

__all__ = ["OP", "cp_gather_cache", "validate", "select_implementation"]

OP = "cp_gather_cache"


def validate(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts=None) -> int:
    """Check every argument of :func:`cp_gather_cache`; return B. Raises TypeError/ValueError
    naming the argument, what was expected and what came."""
    for name, t in (("src_cache", src_cache), ("dst", dst), ("block_table", block_table),
                    ("cu_seq_lens", cu_seq_lens)):
        require_tensor(name, t)
    if src_cache.dim() < 2:
        raise ValueError(f"src_cache: expected at least 2 dims [num_blocks, block_size, ...], got "
                         f"shape {_shape(src_cache)}")
    if dst.dim() != src_cache.dim() - 1 or dst.shape[1:] != src_cache.shape[2:]:
        raise ValueError(f"dst: expected shape [T_out, {', '.join(map(str, src_cache.shape[2:]))}]"
                         f" (an entry of src_cache {_shape(src_cache)} per row), got "
                         f"{_shape(dst)}")
    check_like("dst", dst, "src_cache", src_cache, "dtype")
    device = src_cache.device
    if dst.device != device:
        raise ValueError(f"dst: expected device {device} (that of src_cache), got {dst.device}")
    check_index("cu_seq_lens", cu_seq_lens, 1, 1, "B + 1 >= 1", device, "src_cache")
    num_req = cu_seq_lens.shape[0] - 1
    batch_size = check_count("batch_size", batch_size)
    if batch_size != num_req:
        raise ValueError(f"batch_size: expected cu_seq_lens.numel() - 1 = {num_req}, got "
                         f"{batch_size}")
    check_requests(block_table=block_table, starts=cu_seq_lens, starts_name="cu_seq_lens",
                   num_req=num_req, seq_starts=seq_starts, device=device, device_of="src_cache")
    check_mutation_safe(outputs=(("dst", dst),),
                        inputs=(("src_cache", src_cache), ("block_table", block_table),
                                ("cu_seq_lens", cu_seq_lens), ("seq_starts", seq_starts)))
    return num_req


def select_implementation(src_cache, dst, implementation: str | None = None) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (src_cache, dst), implementation)


@registry.custom_op(OP, mutates=("dst",), args={"batch_size": registry.INT})
def cp_gather_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                    cu_seq_lens: torch.Tensor, batch_size: int,
                    seq_starts: torch.Tensor | None = None, *,
                    implementation: str | None = None) -> None:
    """Gather cache entries of any dtype and shape into ``dst`` rows, bit for bit; mutates ``dst``
    only (docs/ops/gather.md).

    Request ``r < B = batch_size = cu_seq_lens.numel() - 1`` owns rows
    ``[cu_seq_lens[r], cu_seq_lens[r + 1])`` of ``dst`` and reads positions
    ``p = seq_starts[r] + (t - cu_seq_lens[r])`` (``seq_starts`` None: 0): slot ``p % bs`` of block
    ``block_table[r, p // bs]``. Row ``t < dst.shape[0]`` receives the bits of
    ``src_cache[block, slot]`` iff a request owns it, ``p >= 0``, ``p // bs <
    block_table.shape[1]`` and the block id lies in ``[0, num_blocks)``; every other row keeps its
    bytes, and nothing outside the cache or the index tensors is read.

    Shapes: ``src_cache`` ``[num_blocks, bs, *entry]`` and ``dst`` ``[T_out, *entry]`` of one dtype
    (any), any strides; ``block_table`` ``[>= B, max_blocks]``, ``cu_seq_lens`` ``[B + 1]``,
    ``seq_starts`` ``[>= B]``: int32 or int64, any strides, read on the device (CUDA-graph safe).
    """
    num_req = validate(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts)
    info = select_implementation(src_cache, dst, implementation)
    if num_req == 0 or dst.numel() == 0:
        return
    info.run(src_cache, dst, block_table, cu_seq_lens, seq_starts)
