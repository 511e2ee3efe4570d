"""gather_and_maybe_dequant_cache: the public op, its validation and its torch.compile custom op
(docs/ops/gather.md)."""

from __future__ import annotations

import torch

from ... import registry
from ...dtypes import INPUT_DTYPES
from ...formats import MlaMode
from ...gather import check_index, check_requests, check_scale
from ...validation import check_count, check_mutation_safe, require_tensor
from ...validation import shape_str as _shape
from ..concat_and_cache_mla.op import parse_mla_mode

__all__ = ["OP", "gather_and_maybe_dequant_cache", "validate", "select_implementation"]

OP = "gather_and_maybe_dequant_cache"


def validate(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
             kv_cache_dtype, scale=None, seq_starts=None) -> tuple[MlaMode, int, int]:
    """Check every argument of :func:`gather_and_maybe_dequant_cache`; return (mode, B,
    num_tokens). Raises TypeError/ValueError naming the argument, what was expected and what came.
    """
    mode = parse_mla_mode(kv_cache_dtype)
    if mode.format.reader != OP:
        raise ValueError(f"kv_cache_dtype: expected 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', got "
                         f"{mode.value!r} (its entries are read by {mode.format.reader})")
    for name, t in (("src_cache", src_cache), ("dst", dst), ("block_table", block_table),
                    ("cu_seq_lens", cu_seq_lens), ("token_to_seq", token_to_seq)):
        require_tensor(name, t)
    if src_cache.dim() != 3:
        raise ValueError(f"src_cache: expected 3 dims [num_blocks, block_size, entry_size], got "
                         f"shape {_shape(src_cache)}")
    if dst.dim() != 2:
        raise ValueError(f"dst: expected 2 dims [num_tokens, entry_size], got shape {_shape(dst)}")
    if dst.dtype not in INPUT_DTYPES:
        raise ValueError(f"dst: expected dtype float16, bfloat16 or float32, got {dst.dtype}")
    entry = src_cache.shape[2]
    if dst.shape[1] != entry:
        raise ValueError(f"dst: expected a last dim of {entry} (that of src_cache), got shape "
                         f"{_shape(dst)}")
    for name, t in (("src_cache", src_cache), ("dst", dst)):
        if entry > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit-stride last dim, got strides "
                             f"{tuple(t.stride())}")
    if mode is MlaMode.AUTO:
        if src_cache.dtype != dst.dtype:
            raise ValueError(f"src_cache: kv_cache_dtype='auto' expects the dtype of dst "
                             f"({dst.dtype}), got {src_cache.dtype}")
    elif src_cache.dtype not in mode.format.storage:  # (torch.uint8, the float8 dtype)
        raise ValueError(f"src_cache: kv_cache_dtype={mode.value!r} expects a cache of dtype "
                         f"torch.uint8 or {mode.fp8_dtype}, got {src_cache.dtype}")
    num_tokens = check_count("num_tokens", num_tokens)
    if num_tokens > dst.shape[0]:
        raise ValueError(f"num_tokens: expected at most dst.shape[0] = {dst.shape[0]}, got "
                         f"{num_tokens}")
    device = src_cache.device
    if dst.device != device:
        raise ValueError(f"dst: expected device {device} (that of src_cache), got {dst.device}")
    check_index("cu_seq_lens", cu_seq_lens, 1, 1, "B + 1 >= 1", device, "src_cache")
    num_req = cu_seq_lens.shape[0] - 1
    check_requests(block_table=block_table, starts=cu_seq_lens, starts_name="cu_seq_lens",
                   num_req=num_req, seq_starts=seq_starts, device=device, device_of="src_cache")
    check_index("token_to_seq", token_to_seq, 1, num_tokens,
                f"one per gathered row, num_tokens = {num_tokens}", device, "src_cache")
    if mode.uses_scale:
        check_scale("scale", scale, mode.value, device, "src_cache")
    check_mutation_safe(outputs=(("dst", dst),),
                        inputs=(("src_cache", src_cache), ("block_table", block_table),
                                ("cu_seq_lens", cu_seq_lens), ("token_to_seq", token_to_seq),
                                ("seq_starts", seq_starts),
                                ("scale", scale if mode.uses_scale else None)))
    return mode, num_req, num_tokens


def select_implementation(src_cache, dst, mode: MlaMode, implementation: str | None = None,
                          ) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (src_cache, dst, mode), implementation)


@registry.custom_op(OP, mutates=("dst",), args={"num_tokens": registry.INT})
def gather_and_maybe_dequant_cache(src_cache: torch.Tensor, dst: torch.Tensor,
                                   block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                                   token_to_seq: torch.Tensor, num_tokens: int,
                                   kv_cache_dtype: str = "auto",
                                   scale: torch.Tensor | None = None,
                                   seq_starts: torch.Tensor | None = None, *,
                                   implementation: str | None = None) -> None:
    """Gather the MLA cache entries of a batch of sequences into ``dst`` rows; mutates ``dst``
    only (docs/ops/gather.md).

    Request ``r < B = cu_seq_lens.numel() - 1`` owns rows ``[cu_seq_lens[r], cu_seq_lens[r + 1])``
    of ``dst`` and reads positions ``p = seq_starts[r] + (t - cu_seq_lens[r])`` (``seq_starts``
    None: 0) of its sequence: slot ``p % bs`` of block ``block_table[r, p // bs]``. Row
    ``t < num_tokens`` is written iff a request owns it, ``p >= 0``, ``p // bs <
    block_table.shape[1]`` and the block id lies in ``[0, num_blocks)``; every other row keeps its
    bytes, and nothing outside the cache or the index tensors is read.

    A written row is the entry's bits ("auto": ``dst`` has the cache's dtype) or, for
    "fp8"/"fp8_e4m3"/"fp8_e5m2", ``(code as float8).float() * scale`` rounded to ``dst``'s dtype
    (exact decode, one float32 product, round to nearest even, no saturation).

    Shapes: ``src_cache`` ``[num_blocks, bs, E]`` (unit last stride, other strides free; uint8 or
    the float8 dtype in the fp8 modes), ``dst`` ``[>= num_tokens, E]`` float16/bfloat16/float32
    (unit last stride); ``block_table`` ``[>= B, max_blocks]``, ``cu_seq_lens`` ``[B + 1]``,
    ``seq_starts`` ``[>= B]``, ``token_to_seq`` ``[>= num_tokens]`` (checked, never read): int32 or
    int64, any strides, read on the device (CUDA-graph safe). ``scale``: float32, 1 element, on
    the device (fp8 modes; may be None in "auto").
    """
    mode, num_req, num_tokens = validate(src_cache, dst, block_table, cu_seq_lens, token_to_seq,
                                         num_tokens, kv_cache_dtype, scale, seq_starts)
    info = select_implementation(src_cache, dst, mode, implementation)
    if num_tokens == 0 or num_req == 0:
        return
    info.run(src_cache, dst, block_table, cu_seq_lens, seq_starts, num_tokens, mode,
             scale if mode.uses_scale else None)
