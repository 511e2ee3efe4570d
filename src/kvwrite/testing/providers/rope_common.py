"""What the conformance providers of rotary_embedding and fused_rope_and_reshape_cache_flash
share: the call that the bad-input cases start from, the changes both ops reject, and the graph
and torch.compile cases (the rotation and the layouts against independent oracles:
tests/test_rope.py)."""

from __future__ import annotations

import torch

from kvwrite.layouts import KVAlloc, Layout

from ..conformance import Example, small_tiles
from ..rope import RopeCase

__all__ = ["VCASE", "COMMON_BAD", "graph_case", "compile_case", "graph_and_compile_cases", "meta",
           "heads"]


def heads(t, d):
    """A 2-D ``[T, H * d]`` row tensor as ``[T, H, d]`` (3-D and None stay)."""
    return None if t is None else (t if t.dim() == 3 else t.unflatten(1, (-1, d)))


VCASE = RopeCase(num_tokens=5, num_q_heads=4, num_heads=2, head_size=16, kv_cache_dtype="fp8",
                 num_blocks=4)


def meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


# (name, change, exception, text the message must contain); shared by both ops where the
# argument exists in both.
COMMON_BAD = [
    ("positions-not-tensor", lambda a: {"positions": a["positions"].tolist()}, TypeError,
     "positions: expected a torch.Tensor, got list"),
    ("positions-2d", lambda a: {"positions": a["positions"][None]}, ValueError,
     "positions: expected 1 dim"),
    ("positions-float", lambda a: {"positions": a["positions"].float()}, ValueError,
     "positions: expected dtype int64 or int32, got torch.float32"),
    ("positions-strided", lambda a: {"positions": a["positions"].repeat(2)[::2]}, ValueError,
     "positions: expected a contiguous tensor"),
    ("positions-too-many", lambda a: {"positions": torch.zeros(6, dtype=torch.long)}, ValueError,
     "positions: expected at most"),
    ("positions-device", lambda a: {"positions": meta(a["positions"])}, ValueError,
     "positions: expected device cpu (that of query), got meta"),
    ("query-4d", lambda a: {"query": a["query"][None]}, ValueError, "query: expected 2 dims"),
    ("query-int", lambda a: {"query": a["query"].int()}, ValueError,
     "query: expected dtype float16, bfloat16 or float32, got torch.int32"),
    ("query-dtype", lambda a: {"query": a["query"].half()}, ValueError, "the dtype of"),
    ("query-sparse-heads", lambda a: {"query": torch.cat([a["query"], a["query"]], -1)[..., ::2]},
     ValueError, "query: expected a unit-stride head dim, got strides (128, 32, 2)"),
    ("query-flat-strided", lambda a: {"query": torch.cat([a["query"], a["query"]], -1)
                                      .flatten(1)[:, ::2]},
     ValueError, "query: expected a unit-stride row (the 2-D form has dense heads)"),
    # Padded heads are valid, but not heads that share memory in a tensor the op writes.
    ("query-overlapping-heads", lambda a: {"query": a["query"].as_strided((5, 4, 16),
                                                                          (64, 8, 1))},
     ValueError, "query: expected every element in its own memory"),
    ("table-1d", lambda a: {"cos_sin_cache": a["cos_sin_cache"][0]}, ValueError,
     "cos_sin_cache: expected 2 dims"),
    ("table-odd-rot", lambda a: {"cos_sin_cache": a["cos_sin_cache"][:, :15].contiguous()},
     ValueError, "cos_sin_cache: expected an even rot_dim in [2, head_size = 16]"),
    ("table-too-wide", lambda a: {"cos_sin_cache": torch.zeros(8, 18)}, ValueError,
     "cos_sin_cache: expected an even rot_dim"),
    ("table-empty", lambda a: {"cos_sin_cache": torch.zeros(0, 16)}, ValueError,
     "cos_sin_cache: expected at least one position"),
    ("table-dtype", lambda a: {"cos_sin_cache": a["cos_sin_cache"].double()}, ValueError,
     "cos_sin_cache: expected dtype float32, float16 or bfloat16, got torch.float64"),
    ("table-strided", lambda a: {"cos_sin_cache": torch.zeros(8, 32)[:, ::2]}, ValueError,
     "cos_sin_cache: expected a contiguous tensor"),
    ("table-device", lambda a: {"cos_sin_cache": meta(a["cos_sin_cache"])}, ValueError,
     "cos_sin_cache: expected device cpu"),
    ("is-neox-int", lambda a: {"is_neox": 1}, TypeError, "is_neox: expected a bool, got int"),
]



def graph_case(fused: bool, padded: bool) -> RopeCase:
    """Padded: D = 128 in rows of 192 (query, key, value), as vLLM slices them."""
    return RopeCase(num_tokens=40, num_q_heads=8, num_heads=2, head_size=128, dtype=torch.bfloat16,
                    kv_cache_dtype="fp8" if fused else "auto", per_head_scale=True,
                    layout=Layout.HND, alloc=KVAlloc.PACKED, padding_slots=3, bad_positions=2,
                    num_blocks=8, pos_dtype=torch.int32,
                    head_pad=(64, 64, 64, 0) if padded else (0, 0, 0, 0))


def compile_case(padded: bool) -> RopeCase:
    """Padded: D = 64 in rows of 128 (query, key) and 96 (value)."""
    return RopeCase(num_tokens=9, dtype=torch.float16, bad_positions=2, padding_slots=2,
                    layout=Layout.HND, head_pad=(64, 64, 32, 0) if padded else (0, 0, 0, 0))


def graph_and_compile_cases(fused: bool) -> dict:
    """The Provider fields of both ops' CUDA-graph and torch.compile cases, dense and padded
    heads: the variant's first call is in the capture; two replays with new inputs; and their
    small tiles (D = 8, 10 with partial GPT-J rotary, 16)."""
    padded = (("dense", False), ("padded", True))
    return dict(graph_warmup=False, graph_seeds=(1, 2, 3),
                graph_cases=tuple(Example(n, graph_case(fused, p)) for n, p in padded),
                compile_cases=tuple(Example(n, compile_case(p)) for n, p in padded),
                small_tile_cases=small_tiles(
                    RopeCase(num_tokens=3, num_q_heads=2, num_heads=1, dtype=torch.float16),
                    dict(head_size=8), dict(num_tokens=2, head_size=10, rot_dim=4, is_neox=False),
                    dict(head_size=16, num_q_heads=1, dtype=torch.bfloat16,
                         kv_cache_dtype="fp8" if fused else "auto")))
