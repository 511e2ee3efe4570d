"""The correctness check run before an implementation is timed at a point.

It runs on the benchmark's own cache (the real size, strides and slots, so 64-bit indexing is
exercised), and costs a few passes over the written rows instead of copies of a cache that may
fill the GPU:

1. Poison: every target row (K and V of each token's slot) is set to the bitwise complement of
   its expected bytes, so a row the implementation fails to write, in whole or in part, differs.
2. Snapshot the *checked blocks*: the blocks holding written slots (all of them, or a random
   subset of ``SNAPSHOT_BYTES`` of K+V blocks when there are more), plus guard blocks: the first and last block of the cache
   and a few untouched blocks at random. Blocks cover the whole allocation (both halves of an
   interleaved or packed cache).
3. Run the implementation once on input set 0.
4. Written rows: every token's K and V rows are compared byte for byte with the reference's
   quantization of its input (``kvwrite.dtypes.quantize``, what the torch reference writes).
5. Checked blocks: the torch reference is run on the snapshot (slots remapped into it), and the
   blocks read back from the cache must equal it byte for byte — this catches stray writes into
   other slots, heads or the other half of the allocation.

fp8 comparisons count two NaNs (any sign or payload) as equal, as the test suite does. Bytes
outside the checked blocks and the written rows are not compared: at 64 GiB that would need a copy
of the cache.
"""

from __future__ import annotations

import torch

from ..dtypes import quantize
from ..ops.reshape_and_cache_flash import reference as torch_ref
from ..testing.compare import differing_bytes
from .workload import CHUNK_BYTES, Case, InputSet

__all__ = ["check_point", "SNAPSHOT_BYTES", "GUARD_BLOCKS"]

SNAPSHOT_BYTES = 32 * 2**20
GUARD_BLOCKS = 16


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``[n, H, D]`` rows as ``[n, H, D * element_size]`` bytes."""
    return t.contiguous().view(torch.uint8)


def _expected(src: torch.Tensor, shape: Case, scale, cache: torch.Tensor) -> torch.Tensor:
    return quantize(src, shape.cache_dtype, scale, cache.dtype)


def _differs(got: torch.Tensor, want: torch.Tensor, shape: Case) -> torch.Tensor | None:
    """None when ``got`` and ``want`` hold the same bytes, else a mask of differing ``[n, bs?, H]``
    rows. For fp8, two NaNs (any sign or payload) count as equal, as in the test suite."""
    fp8 = shape.cache_dtype.fp8_dtype if shape.cache_dtype.is_fp8 else None
    rows = differing_bytes(_byte_rows(got), _byte_rows(want), fp8).any(dim=-1)
    return rows if bool(rows.any()) else None


def _token_chunks(num_tokens: int, shape: Case):
    per_token = shape.num_heads * shape.head_size * max(4, shape.in_bytes)
    step = max(1, CHUNK_BYTES // (4 * per_token))
    for t0 in range(0, num_tokens, step):
        yield slice(t0, min(num_tokens, t0 + step))


def _checked_blocks(slots: torch.Tensor, shape: Case) -> torch.Tensor:
    """Sorted ids of the checked blocks: touched ones (a random subset past the budget) + guards."""
    touched = torch.unique(slots // shape.block_size)
    budget = max(1, SNAPSHOT_BYTES // shape.block_bytes)
    gen = torch.Generator(device="cpu").manual_seed(0)
    if touched.numel() > budget:
        touched = touched[torch.randperm(touched.numel(), generator=gen)[:budget].to(touched.device)]
    guards = torch.randint(0, shape.num_blocks, (GUARD_BLOCKS,), generator=gen).to(touched.device)
    ends = torch.tensor([0, shape.num_blocks - 1], device=touched.device)
    return torch.unique(torch.cat([touched, guards, ends]))


def check_point(run, key_cache: torch.Tensor, value_cache: torch.Tensor, inp: InputSet,
                shape: Case) -> str | None:
    """Run ``run`` once on ``inp`` as described in the module doc; None if correct, else why.

    ``run`` is an implementation's ``run``. The caches are left holding the implementation's
    result. Padding (negative) and out-of-range slots write nothing: their tokens are left out of
    the row checks, and a write they cause shows in the checked blocks.
    """
    all_slots = inp.slot_mapping
    real = ((all_slots >= 0) & (all_slots < shape.num_slots)).nonzero().flatten()
    slots = all_slots[real]
    blocks, offsets = slots // shape.block_size, slots % shape.block_size
    pairs = ((inp.key[real], key_cache, inp.k_scale, "key_cache"),
             (inp.value[real], value_cache, inp.v_scale, "value_cache"))
    for src, cache, scale, _ in pairs:
        raw = cache.view(torch.uint8)
        for c in _token_chunks(slots.numel(), shape):
            raw[blocks[c], offsets[c]] = torch.bitwise_not(_byte_rows(_expected(src[c], shape,
                                                                                  scale, cache)))

    sel = _checked_blocks(slots, shape)
    snap_k, snap_v = key_cache[sel], value_cache[sel]

    run(*inp.run_args(key_cache, value_cache, shape.cache_dtype))

    for src, cache, scale, name in pairs:
        for c in _token_chunks(slots.numel(), shape):
            bad = _differs(cache[blocks[c], offsets[c]], _expected(src[c], shape, scale, cache), shape)
            if bad is not None:
                tokens = bad.any(dim=-1).nonzero().flatten() + c.start
                t = int(tokens[0])
                return (f"{name}: {tokens.numel()} of the rows of {c.stop - c.start} tokens "
                        f"differ from the reference (first: token {int(real[t])}, slot "
                        f"{int(slots[t])})")

    # Remap each token whose block was snapshotted to its place in the snapshot; -1 skips.
    where = torch.searchsorted(sel, blocks)
    inside = (where < sel.numel()) & (sel[where.clamp(max=sel.numel() - 1)] == blocks)
    local = torch.where(inside, where * shape.block_size + offsets, torch.full_like(slots, -1))
    ref_args = InputSet(pairs[0][0], pairs[1][0], local, inp.k_scale, inp.v_scale)
    torch_ref.run(*ref_args.run_args(snap_k, snap_v, shape.cache_dtype))
    for got, want, name in ((key_cache[sel], snap_k, "key_cache"),
                            (value_cache[sel], snap_v, "value_cache")):
        bad = _differs(got, want, shape)
        if bad is not None:
            where = bad.any(dim=-1).nonzero()  # (snapshot block, offset) pairs
            i, off = (int(x) for x in where[0])
            slot = int(sel[i]) * shape.block_size + off
            kind = "a written slot" if slot in set(slots.tolist()) else "a slot no token writes"
            return (f"{name}: {where.shape[0]} slots of the {sel.numel()} checked blocks differ "
                    f"from the reference (first: block {int(sel[i])}, offset {off}: {kind})")
    return None
