"""``flashinfer``: FlashInfer's ``flashinfer.page.append_paged_kv_cache``, offered where it imports.

FlashInfer describes a write by request instead of by slot: token i goes to request
``batch_indices[i]`` at position ``positions[i]``, i.e. to entry ``positions[i] % page_size`` of
page ``kv_indices[kv_indptr[batch_indices[i]] + positions[i] // page_size]`` (its documented page
table: ``kv_indptr`` [batch + 1], ``kv_indices`` [kv_indptr[-1]], ``kv_last_page_len`` [batch]).
:func:`one_request` states kvwrite's slots that way, as docs/ops/reshape_and_cache_flash.md says:
one request owning every block in order (``kv_indices = arange(num_blocks)``, ``positions = slot``,
``batch_indices = 0``).
:func:`per_sequence` states a slot pattern's sequences with their own block tables, as a server's
page table would (the two put every row in the same place; tests/test_peers.py checks both).

The conversion is done by :func:`prepare`, once per slot tensor and outside the timed calls (as
FlashInfer's users build their page table once per step); ``run`` only looks it up. FlashInfer
has no padding (a position of -1 would address outside the cache) and no fp8 scaling (it copies
rows of the cache's dtype), so those cases say so. Its kernel runs (head_size / vec) x H threads
per block, vec = max(16 / element size, head_size / 32): past 1024 the launch fails.

The FlashInfer subset that /work/shared/tools/flashinfer_subset.py makes (``flashinfer/page.py``
without the package's heavy ``__init__``) is found on ``sys.path`` too.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
import weakref
from pathlib import Path

import torch

from ....dtypes import CacheDType

HEAD_DIMS = (64, 128, 256, 512)
MAX_THREADS = 1024


def _bare_packages() -> None:
    """Register ``flashinfer`` and ``flashinfer.jit`` as bare packages where their folder holds
    page.py, so that ``flashinfer.page`` imports without the package's __init__ (the subset)."""
    for entry in sys.path:
        root = Path(entry or ".") / "flashinfer"
        if (root / "page.py").is_file():
            for name, path in (("flashinfer", root), ("flashinfer.jit", root / "jit")):
                if name not in sys.modules:
                    mod = types.ModuleType(name)
                    mod.__path__ = [str(path)]
                    sys.modules[name] = mod
            return


@functools.cache
def _load():
    """(flashinfer.page, None) or (None, why not)."""
    try:
        return importlib.import_module("flashinfer.page"), None
    except Exception as first:  # the full package's __init__ can fail on a partial install
        for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
            del sys.modules[name]
        _bare_packages()
        try:
            return importlib.import_module("flashinfer.page"), None
        except Exception as e:
            return None, (f"flashinfer is not installed or does not import (flashinfer.page: "
                          f"{type(first).__name__}: {first}; without its __init__: "
                          f"{type(e).__name__}: {e})")


def available(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"flashinfer runs on CUDA devices, got {device}"
    return _load()[1]


def unsupported(key, key_cache, cache_dtype: CacheDType, k_scale, v_scale) -> str | None:
    if cache_dtype.is_fp8 or cache_dtype.element_dtype(key.dtype) != key.dtype:
        return ("FlashInfer's append_paged_kv_cache copies rows without conversion or scaling "
                f"(kv_cache_dtype {cache_dtype.value} with {str(key.dtype).removeprefix('torch.')} "
                "input; a copy of pre-quantized fp8 rows would not be the same work)")
    if key.dtype not in (torch.float16, torch.bfloat16):
        return f"FlashInfer's append_paged_kv_cache takes float16 or bfloat16, got {key.dtype}"
    d, h = key.shape[2], key.shape[1]
    if d not in HEAD_DIMS:
        return f"FlashInfer's append_paged_kv_cache is built for head sizes {HEAD_DIMS}, got {d}"
    vec = max(16 // key.element_size(), d // 32)
    if d // vec * h > MAX_THREADS:
        return (f"FlashInfer's append_paged_kv_cache runs (head_size/vec) x H = {d // vec} x {h} "
                f"threads per block, more than {MAX_THREADS}: the launch fails")
    if key_cache.shape[0] * key_cache.shape[1] >= 2**31:
        return "FlashInfer's positions are int32: the cache has 2^31 slots or more"
    return None


# --- the conversion -----------------------------------------------------------------------------

def cache_layout(key_cache: torch.Tensor) -> str:
    """FlashInfer's kv_layout of a logical [num_blocks, block_size, H, D] cache."""
    return "HND" if key_cache.stride(1) < key_cache.stride(2) else "NHD"


def physical(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The cache as FlashInfer indexes it: [pages, page_size, H, D] (NHD) or [pages, H, page_size,
    D] (HND); a view, strides kept."""
    return cache.transpose(1, 2) if layout == "HND" else cache


def one_request(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> dict:
    """FlashInfer's arguments for slots >= 0: one request owning every block in order."""
    dev = slot_mapping.device
    i32 = torch.int32
    return dict(batch_indices=torch.zeros(slot_mapping.numel(), dtype=i32, device=dev),
                positions=slot_mapping.to(i32),
                kv_indices=torch.arange(num_blocks, dtype=i32, device=dev),
                kv_indptr=torch.tensor([0, num_blocks], dtype=i32, device=dev),
                kv_last_page_len=torch.tensor([block_size], dtype=i32, device=dev))


def per_sequence(sequences, block_size: int, device: torch.device | str = "cpu") -> dict:
    """FlashInfer's arguments for a slot pattern's sequences (``kvwrite.testing.slots.Sequence``:
    block table, start, num_new), in token order: each sequence is one request."""
    batch, pos, indices, indptr, last = [], [], [], [0], []
    for b, s in enumerate(sequences):
        batch += [b] * s.num_new
        pos += range(s.start, s.start + s.num_new)
        indices += s.block_table
        indptr.append(len(indices))
        end = s.start + s.num_new
        last.append(end - (len(s.block_table) - 1) * block_size)
    return {k: torch.tensor(v, dtype=torch.int32, device=device) for k, v in
            dict(batch_indices=batch, positions=pos, kv_indices=indices, kv_indptr=indptr,
                 kv_last_page_len=last).items()}


# Conversions by slot tensor: id -> (weak reference, version, num_blocks, block_size, args).
_PREPARED: dict[int, tuple] = {}


def prepare(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale,
            v_scale) -> str | None:
    """Convert ``slot_mapping`` once (a host sync: call it before timing or capturing); None
    when ready, else why FlashInfer cannot run these slots."""
    num_blocks, block_size = key_cache.shape[:2]
    if slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < 0:
            n = int((slot_mapping < 0).sum())
            return (f"FlashInfer's append_paged_kv_cache has no padding slots: {n} of the slots "
                    f"are negative (its position would address outside the cache)")
        if hi >= num_blocks * block_size:
            return f"FlashInfer would write outside the cache for slot {hi}"
    key_id = id(slot_mapping)
    ref = weakref.ref(slot_mapping, lambda _: _PREPARED.pop(key_id, None))
    _PREPARED[key_id] = (ref, slot_mapping._version, num_blocks, block_size,
                         one_request(slot_mapping, num_blocks, block_size))
    return None


def _prepared(slot_mapping: torch.Tensor, key_cache: torch.Tensor) -> dict | None:
    entry = _PREPARED.get(id(slot_mapping))
    if entry is None:
        return None
    ref, version, num_blocks, block_size, args = entry
    if (ref() is not slot_mapping or version != slot_mapping._version
            or (num_blocks, block_size) != tuple(key_cache.shape[:2])):
        return None
    return args


def run(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale) -> None:
    if slot_mapping.numel() == 0:  # its launch grid would be empty (an invalid configuration)
        return
    args = _prepared(slot_mapping, key_cache)
    if args is None:
        reason = prepare(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale,
                         v_scale)
        if reason is not None:
            raise ValueError(f"implementation 'flashinfer': {reason}")
        args = _prepared(slot_mapping, key_cache)
    layout = cache_layout(key_cache)
    n = slot_mapping.numel()
    _load()[0].append_paged_kv_cache(
        key[:n], value[:n], args["batch_indices"], args["positions"],
        (physical(key_cache, layout), physical(value_cache, layout)), args["kv_indices"],
        args["kv_indptr"], args["kv_last_page_len"], kv_layout=layout)
