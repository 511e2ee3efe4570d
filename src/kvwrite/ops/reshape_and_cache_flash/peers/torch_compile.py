"""``torch-compile``: the torch reference (:mod:`..reference`) under ``torch.compile`` — the
baseline a PyTorch user would write and compile.

Compiled once per signature by TorchDynamo's own cache (shapes, dtypes, strides and the cache
dtype are guarded; after a second token count it compiles a version with a dynamic token count).
Not graph-safe: the reference masks padding and out-of-range slots with boolean indexing, whose
result size depends on the data, so Dynamo breaks the graph there and the host syncs.
"""

from __future__ import annotations

import functools

import torch

from ....validation import spans_its_storage
from .. import reference


@functools.cache
def _compiled():
    return torch.compile(reference.run)


def available(device: torch.device) -> str | None:
    # Inductor compiles for the CPU with the system's C++ compiler and for CUDA with Triton.
    return None


def unsupported(key, key_cache, cache_dtype, k_scale, v_scale) -> str | None:
    # AOTAutograd refuses to mutate two views of one allocation ("does not yet handle
    # non-differentiable view input mutations"; H200, torch 2.11, a K|V-interleaved cache); a key
    # cache that is part of a larger allocation may be such a view, so it is not offered.
    if key.device.type == "cuda" and not spans_its_storage(key_cache):
        return ("torch.compile cannot write two views of one allocation (key_cache is part of "
                "a larger allocation, e.g. K|V-interleaved)")
    # Inductor fuses the reference's `x.float() / scale` into a Triton kernel whose float32 `/` is
    # approximate (the fp8 rule): on an H100, H=8 D=128 with per-head scales, T=1024 wrote one row
    # that differs from the exact rule. Such a result is not the op, so it is not timed.
    if cache_dtype.is_fp8 and key.device.type == "cuda":
        return ("torch.compile generates Triton code that divides approximately, so its fp8 "
                "results can differ from the exact rule (the fp8 rule)")
    return None


def run(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale) -> None:
    _compiled()(key, value, key_cache, value_cache, slot_mapping, cache_dtype, k_scale, v_scale)
