"""cp_gather_indexer_k_quant_cache: the public op, its validation and its torch.compile custom op
(docs/ops/gather.md)."""

from __future__ import annotations

import torch

from ... import formats, registry
from ...gather import check_index, check_requests
from ...validation import check_mutation_safe, require_tensor
from ...validation import shape_str as _shape

__all__ = ["OP", "cp_gather_indexer_k_quant_cache", "validate", "select_implementation",
           "scale_groups"]

OP = "cp_gather_indexer_k_quant_cache"
# Bytes of one group's scale slot in a row, whatever the scale_fmt (kvwrite.formats).
_SCALE_SLOT = formats.lookup("float32", formats.Family.INDEXER).scales[0].nbytes


def scale_groups(dst_scale: torch.Tensor) -> int:
    """G, the scales per row: ``dst_scale.shape[1] / 4`` (uint8 bytes) or ``dst_scale.shape[1]``
    (float32)."""
    g = dst_scale.shape[1]
    return g // _SCALE_SLOT if dst_scale.dtype == torch.uint8 else g


def validate(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> int:
    """Check every argument of :func:`cp_gather_indexer_k_quant_cache`; return B. Raises
    TypeError/ValueError naming the argument, what was expected and what came."""
    for name, t in (("kv_cache", kv_cache), ("dst_k", dst_k), ("dst_scale", dst_scale),
                    ("block_table", block_table), ("cu_seq_lens", cu_seq_lens)):
        require_tensor(name, t)
    if dst_k.dim() != 2:
        raise ValueError(f"dst_k: expected 2 dims [T_out, head_dim], got shape {_shape(dst_k)}")
    if dst_k.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"dst_k: expected dtype torch.uint8 or torch.float8_e4m3fn, got "
                         f"{dst_k.dtype}")
    if dst_k.shape[1] < 1:
        raise ValueError(f"dst_k: expected a head_dim of at least 1, got shape {_shape(dst_k)}")
    if dst_scale.dim() != 2:
        raise ValueError(f"dst_scale: expected 2 dims [T_out, 4 * G] (uint8) or [T_out, G] "
                         f"(float32), got shape {_shape(dst_scale)}")
    if dst_scale.dtype == torch.uint8:
        if dst_scale.shape[1] < _SCALE_SLOT or dst_scale.shape[1] % _SCALE_SLOT:
            raise ValueError(f"dst_scale: expected [T_out, 4 * G] bytes with G >= 1 (uint8), got "
                             f"shape {_shape(dst_scale)}")
    elif dst_scale.dtype == torch.float32:
        if dst_scale.shape[1] < 1:
            raise ValueError(f"dst_scale: expected [T_out, G] with G >= 1 (float32), got shape "
                             f"{_shape(dst_scale)}")
    else:
        raise ValueError(f"dst_scale: expected dtype torch.uint8 or torch.float32, got "
                         f"{dst_scale.dtype}")
    if dst_scale.shape[0] != dst_k.shape[0]:
        raise ValueError(f"dst_scale: expected {dst_k.shape[0]} rows (those of dst_k), got shape "
                         f"{_shape(dst_scale)}")
    head_dim, groups = dst_k.shape[1], scale_groups(dst_scale)
    width = head_dim + _SCALE_SLOT * groups
    if kv_cache.dim() != 3 or kv_cache.shape[2] != width:
        raise ValueError(f"kv_cache: expected shape [num_blocks, block_size, {width}] (head_dim "
                         f"{head_dim} of dst_k + 4 * {groups} scale bytes of dst_scale), got "
                         f"{_shape(kv_cache)}")
    if kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache: expected dtype torch.uint8, got {kv_cache.dtype}")
    if kv_cache.stride(2) != 1 or (kv_cache.shape[1] > 1 and kv_cache.stride(1) != width):
        raise ValueError(f"kv_cache: expected dense pages (stride(2) == 1, stride(1) == {width}), "
                         f"got strides {tuple(kv_cache.stride())}")
    device = kv_cache.device
    for name, t in (("dst_k", dst_k), ("dst_scale", dst_scale)):
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (that of kv_cache), got "
                             f"{t.device}")
    check_index("block_table", block_table, 2, 0, "any", device, "kv_cache")
    num_req = block_table.shape[0]
    check_requests(block_table=block_table, starts=cu_seq_lens, starts_name="cu_seq_lens",
                   num_req=num_req, seq_starts=None, device=device, device_of="kv_cache")
    check_mutation_safe(outputs=(("dst_k", dst_k), ("dst_scale", dst_scale)),
                        inputs=(("kv_cache", kv_cache), ("block_table", block_table),
                                ("cu_seq_lens", cu_seq_lens)))
    return num_req


def select_implementation(kv_cache, dst_k, dst_scale,
                          implementation: str | None = None) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (kv_cache, dst_k, dst_scale), implementation)


@registry.custom_op(OP, mutates=("dst_k", "dst_scale"))
def cp_gather_indexer_k_quant_cache(kv_cache: torch.Tensor, dst_k: torch.Tensor,
                                    dst_scale: torch.Tensor, block_table: torch.Tensor,
                                    cu_seq_lens: torch.Tensor, *,
                                    implementation: str | None = None) -> None:
    """Gather the DeepSeek-V3.2 indexer's quantized keys and their scales of a batch of sequences;
    mutates ``dst_k`` and ``dst_scale`` only (docs/ops/gather.md).

    The cache's page layout: block ``b``'s page is the ``bs * (D + 4G)`` bytes from
    ``kv_cache[b, 0, 0]``, all codes first (the token at offset ``o``: bytes ``[o*D, o*D + D)``),
    then all scales (its group ``g``: the float32 at bytes ``[bs*D + 4*(o*G + g), +4)``).

    Request ``r < B = block_table.shape[0]`` owns rows ``[cu_seq_lens[r], cu_seq_lens[r + 1])``
    of the outputs and reads positions ``p = t - cu_seq_lens[r]``: slot ``p % bs`` of block
    ``block_table[r, p // bs]``. Row ``t < T_out = dst_k.shape[0]`` receives its position's ``D``
    code bytes and ``G`` scales, bit for bit, iff a request owns it, ``p // bs <
    block_table.shape[1]`` and the block id lies in ``[0, num_blocks)``; every other row keeps its
    bytes (``T_out`` may be an upper bound), and nothing outside the cache or the index tensors is
    read.

    Shapes: ``kv_cache`` ``[num_blocks, bs, D + 4G]`` uint8 with dense pages (``stride(2) == 1``,
    ``stride(1) == D + 4G``; ``stride(0)`` free); ``dst_k`` ``[T_out, D]`` uint8 or float8_e4m3fn
    and ``dst_scale`` ``[T_out, 4G]`` uint8 or ``[T_out, G]`` float32, any strides;
    ``block_table`` ``[B, max_blocks]`` and ``cu_seq_lens`` ``[>= B + 1]``: int32 or int64, any
    strides, read on the device (CUDA-graph safe).
    """
    num_req = validate(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
    info = select_implementation(kv_cache, dst_k, dst_scale, implementation)
    if num_req == 0 or dst_k.shape[0] == 0:
        return
    info.run(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
