"""gather_cache_flash: the public op, its validation and its torch.compile custom op
(docs/ops/gather.md)."""

from __future__ import annotations

import torch

from ... import registry
from ...dtypes import INPUT_DTYPES, CacheDType, allowed_cache_dtypes, parse_kv_cache_dtype
from ...gather import check_index, check_requests, check_scale
from ...validation import check_like, check_mutation_safe, require_tensor
from ...validation import shape_str as _shape

__all__ = ["OP", "gather_cache_flash", "validate", "select_implementation"]

OP = "gather_cache_flash"


def validate(key_cache, value_cache, key_out, value_out, block_table, cu_seq_lens,
             kv_cache_dtype, k_scale=None, v_scale=None, seq_starts=None) -> tuple[CacheDType, int]:
    """Check every argument of :func:`gather_cache_flash`; return (cache dtype, B). Raises
    TypeError/ValueError naming the argument, what was expected and what came."""
    cache_dtype = parse_kv_cache_dtype(kv_cache_dtype)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("key_out", key_out),
                    ("value_out", value_out), ("block_table", block_table),
                    ("cu_seq_lens", cu_seq_lens)):
        require_tensor(name, t)
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache: expected 4 dims [num_blocks, block_size, num_heads, "
                         f"head_size], got shape {_shape(key_cache)}")
    check_like("value_cache", value_cache, "key_cache", key_cache, "shape", "dtype", "strides")
    num_heads, head_size = key_cache.shape[2:]
    if head_size > 1 and key_cache.stride(3) != 1:
        raise ValueError(f"key_cache: expected a unit-stride last dim, got strides "
                         f"{tuple(key_cache.stride())}")
    if key_out.dim() != 3 or key_out.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key_out: expected shape [T_out, {num_heads}, {head_size}] (the heads "
                         f"of key_cache), got {_shape(key_out)}")
    check_like("value_out", value_out, "key_out", key_out, "shape", "dtype")
    for name, t in (("key_out", key_out), ("value_out", value_out)):
        if head_size > 1 and t.stride(2) != 1:
            raise ValueError(f"{name}: expected a unit-stride last dim, got strides "
                             f"{tuple(t.stride())}")
    if key_out.dtype not in INPUT_DTYPES:
        raise ValueError(f"key_out: expected dtype float16, bfloat16 or float32, got "
                         f"{key_out.dtype}")
    if cache_dtype.is_fp8:
        allowed = allowed_cache_dtypes(cache_dtype, key_out.dtype)
    elif cache_dtype is CacheDType.AUTO:
        allowed = (key_out.dtype,)
    else:
        allowed = allowed_cache_dtypes(cache_dtype, key_out.dtype)
    if key_cache.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise ValueError(f"key_cache: kv_cache_dtype={cache_dtype.value!r} with {key_out.dtype} "
                         f"outputs expects a cache of dtype {names}, got {key_cache.dtype}")
    if not cache_dtype.is_fp8 and key_out.dtype != key_cache.dtype:
        raise ValueError(f"key_out: kv_cache_dtype={cache_dtype.value!r} copies the cache's bits: "
                         f"expected dtype {key_cache.dtype}, got {key_out.dtype}")
    device = key_cache.device
    for name, t in (("value_cache", value_cache), ("key_out", key_out),
                    ("value_out", value_out)):
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (that of key_cache), got "
                             f"{t.device}")
    check_index("cu_seq_lens", cu_seq_lens, 1, 1, "B + 1 >= 1", device, "key_cache")
    num_req = cu_seq_lens.shape[0] - 1
    check_requests(block_table=block_table, starts=cu_seq_lens, starts_name="cu_seq_lens",
                   num_req=num_req, seq_starts=seq_starts, device=device, device_of="key_cache")
    scales = ()
    if cache_dtype.is_fp8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_scale(name, s, cache_dtype.value, device, "key_cache", (1, num_heads))
        scales = (("k_scale", k_scale), ("v_scale", v_scale))
    check_mutation_safe(outputs=(("key_out", key_out), ("value_out", value_out)),
                        inputs=(("key_cache", key_cache), ("value_cache", value_cache),
                                ("block_table", block_table), ("cu_seq_lens", cu_seq_lens),
                                ("seq_starts", seq_starts), *scales))
    return cache_dtype, num_req


def select_implementation(key_cache, key_out, cache_dtype: CacheDType,
                          implementation: str | None = None) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (key_cache, key_out, cache_dtype), implementation)


@registry.custom_op(OP, mutates=("key_out", "value_out"))
def gather_cache_flash(key_cache: torch.Tensor, value_cache: torch.Tensor, key_out: torch.Tensor,
                       value_out: torch.Tensor, block_table: torch.Tensor,
                       cu_seq_lens: torch.Tensor, kv_cache_dtype: str = "auto",
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                       seq_starts: torch.Tensor | None = None, *,
                       implementation: str | None = None) -> None:
    """Gather the key and value rows of a batch of sequences out of paged caches (the read side
    of :func:`kvwrite.reshape_and_cache_flash`); mutates ``key_out`` and ``value_out`` only
    (docs/ops/gather.md).

    Request ``r < B = cu_seq_lens.numel() - 1`` owns rows ``[cu_seq_lens[r], cu_seq_lens[r + 1])``
    of the outputs and reads positions ``p = seq_starts[r] + (t - cu_seq_lens[r])`` (``seq_starts``
    None: 0): slot ``p % bs`` of block ``block_table[r, p // bs]``. Row ``t < key_out.shape[0]`` is
    written iff a request owns it, ``p >= 0``, ``p // bs < block_table.shape[1]`` and the block id
    lies in ``[0, num_blocks)``; every other row keeps its bytes, and nothing outside the caches or
    the index tensors is read.

    A written row, every head ``h``: fp8 modes, ``key_out[t, h, d] = (code as float8).float() *
    k_scale[h or 0]`` rounded to the output dtype (exact decode, one float32 product, round to
    nearest even, no saturation; the same for the value); other modes copy the cache's bits (the
    outputs have the cache's dtype). So ``reshape_and_cache_flash`` then ``gather_cache_flash``
    returns the input exactly in "auto" and the dequantized codes in fp8.

    Shapes: caches logically ``[num_blocks, bs, H, D]`` with equal strides, any but a unit last one
    (NHD, HND, interleaved, packed); ``key_out``/``value_out`` ``[T_out, H, D]`` of one dtype (unit
    last stride, other strides free); ``block_table`` ``[>= B, max_blocks]``, ``cu_seq_lens``
    ``[B + 1]``, ``seq_starts`` ``[>= B]``: int32 or int64, any strides, read on the device
    (CUDA-graph safe); ``k_scale``/``v_scale`` float32 ``[1]`` or ``[H]`` on the device (fp8 modes;
    may be None otherwise).
    """
    cache_dtype, num_req = validate(key_cache, value_cache, key_out, value_out, block_table,
                                    cu_seq_lens, kv_cache_dtype, k_scale, v_scale, seq_starts)
    info = select_implementation(key_cache, key_out, cache_dtype, implementation)
    if num_req == 0 or key_out.numel() == 0:
        return
    if not cache_dtype.is_fp8:
        k_scale = v_scale = None
    info.run(key_cache, value_cache, key_out, value_out, block_table, cu_seq_lens, seq_starts,
             cache_dtype, k_scale, v_scale)
