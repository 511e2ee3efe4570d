"""cp_gather_and_upconvert_fp8_kv_cache: the public op, its validation and its torch.compile custom
op (docs/ops/gather.md)."""

from __future__ import annotations

import torch

from ... import registry
from ...formats import DS_MLA_ENTRY, DS_MLA_L, DS_MLA_P
from ...gather import check_requests
from ...validation import check_count, check_mutation_safe, require_tensor
from ...validation import shape_str as _shape

__all__ = ["OP", "cp_gather_and_upconvert_fp8_kv_cache", "validate", "select_implementation",
           "OUT_WIDTH"]

OP = "cp_gather_and_upconvert_fp8_kv_cache"
OUT_WIDTH = DS_MLA_L + DS_MLA_P  # 576 16-bit values per row: kv_c then k_pe


def validate(src_cache, dst, block_table, workspace_starts, batch_size, seq_starts=None) -> int:
    """Check every argument of :func:`cp_gather_and_upconvert_fp8_kv_cache`; return B. Raises
    TypeError/ValueError naming the argument, what was expected and what came."""
    for name, t in (("src_cache", src_cache), ("dst", dst), ("block_table", block_table),
                    ("workspace_starts", workspace_starts)):
        require_tensor(name, t)
    if src_cache.dim() != 3 or src_cache.shape[2] != DS_MLA_ENTRY:
        raise ValueError(f"src_cache: expected shape [num_blocks, block_size, {DS_MLA_ENTRY}] "
                         f"(fp8_ds_mla entries), got {_shape(src_cache)}")
    if src_cache.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"src_cache: expected dtype torch.uint8 or torch.float8_e4m3fn "
                         f"(fp8_ds_mla codes are e4m3), got {src_cache.dtype}")
    if dst.dim() != 2 or dst.shape[1] != OUT_WIDTH:
        raise ValueError(f"dst: expected shape [T_out, {OUT_WIDTH}], got {_shape(dst)}")
    if dst.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dst: expected dtype bfloat16 or float16, got {dst.dtype}")
    for name, t in (("src_cache", src_cache), ("dst", dst)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit-stride last dim, got strides "
                             f"{tuple(t.stride())}")
    device = src_cache.device
    if dst.device != device:
        raise ValueError(f"dst: expected device {device} (that of src_cache), got {dst.device}")
    num_req = check_count("batch_size", batch_size)
    check_requests(block_table=block_table, starts=workspace_starts,
                   starts_name="workspace_starts", num_req=num_req, seq_starts=seq_starts,
                   device=device, device_of="src_cache", workspace=True)
    check_mutation_safe(outputs=(("dst", dst),),
                        inputs=(("src_cache", src_cache), ("block_table", block_table),
                                ("workspace_starts", workspace_starts),
                                ("seq_starts", seq_starts)))
    return num_req


def select_implementation(src_cache, dst, implementation: str | None = None) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (src_cache, dst), implementation)


@registry.custom_op(OP, mutates=("dst",), args={"batch_size": registry.INT})
def cp_gather_and_upconvert_fp8_kv_cache(src_cache: torch.Tensor, dst: torch.Tensor,
                                         block_table: torch.Tensor,
                                         workspace_starts: torch.Tensor, batch_size: int,
                                         seq_starts: torch.Tensor | None = None, *,
                                         implementation: str | None = None) -> None:
    """Gather fp8_ds_mla cache entries into 16-bit latent rows; mutates ``dst`` only
    (docs/ops/gather.md).

    Request ``r < B = batch_size`` owns rows ``[workspace_starts[r], workspace_starts[r + 1])`` of
    ``dst`` (the last one: up to ``T_out = dst.shape[0]``) and reads positions
    ``p = seq_starts[r] + (t - workspace_starts[r])`` (``seq_starts`` None: 0): slot ``p % bs`` of
    block ``block_table[r, p // bs]``. Row ``t`` is written iff a request owns it, ``p >= 0``,
    ``p // bs < block_table.shape[1]`` and the block id lies in ``[0, num_blocks)``; every other
    row keeps its bytes, and nothing outside the cache or the index tensors is read.

    A written row: ``dst[t, i] = (byte i as e4m3) * s_{i // 128}`` rounded to ``dst``'s dtype for
    ``i < 512`` (``s_j`` the little-endian float32 at bytes ``[512 + 4j, 516 + 4j)``; exact decode,
    one float32 product, round to nearest even, no saturation, any scale value), and
    ``dst[t, 512 + j]`` the 16-bit pattern at bytes ``[528 + 2j, 530 + 2j)``.

    Shapes: ``src_cache`` ``[num_blocks, bs, 656]`` uint8 or float8_e4m3fn (unit last stride, other
    strides free); ``dst`` ``[T_out, 576]`` bfloat16 or float16 (unit last stride);
    ``block_table`` ``[>= B, max_blocks]``, ``workspace_starts`` ``[>= B]``, ``seq_starts``
    ``[>= B]``: int32 or int64, any strides, read on the device (CUDA-graph safe).
    """
    num_req = validate(src_cache, dst, block_table, workspace_starts, batch_size, seq_starts)
    info = select_implementation(src_cache, dst, implementation)
    if num_req == 0 or dst.shape[0] == 0:
        return
    info.run(src_cache, dst, block_table, workspace_starts, num_req, seq_starts)
