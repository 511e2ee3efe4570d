"""rotary_embedding for the conformance suite (the rotation against an independent oracle:
tests/test_rope.py). Every tensor of the call is compared, so a write to one the op only reads
is caught too."""

from __future__ import annotations

import torch

import kvwrite
from kvwrite.ops.rotary_embedding import OP
from kvwrite.ops.rotary_embedding import reference as rope_ref

from ..compare import assert_caches_equal
from ..conformance import Provider, WrongWriter, bad_inputs
from ..rope import RopeCase, make_rope_inputs
from .rope_common import COMMON_BAD, VCASE, graph_and_compile_cases, heads, meta

NAMES = ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox")
TENSORS = (0, 1, 2, 4)


def _check(case, got, want) -> None:
    for i, g, w in zip(TENSORS, got, want, strict=True):
        if w is not None:
            assert_caches_equal(g, w, NAMES[i])


def _skip(info, case: RopeCase, args: tuple) -> str | None:
    positions, query, key, d, cos_sin, neox = args
    return info.unsupported(heads(query, d), heads(key, d), cos_sin, neox)


# --- deliberately wrong rotations (the reference's arguments: [T, H, D] views) ----------------------

def _wrong(write):
    def run(positions, query, key, head_size, cos_sin, neox):
        write(positions, heads(query, head_size), heads(key, head_size), cos_sin, neox)
    return run


def _fma_rotation(positions, q, k, cos_sin, neox):
    """Rotation with x*c - y*s fused (one rounding): differs from the contract on float32 rows."""
    for x in (q, k):
        n = positions.numel()
        half = cos_sin.shape[1] // 2
        cs = cos_sin[positions.long()].double()
        c, s = cs[:, None, :half], cs[:, None, half:]
        xf = x[:n].double()
        a, b = (xf[..., :half], xf[..., half:2 * half]) if neox else (xf[..., 0::2], xf[..., 1::2])
        a2 = (a.float().double() * c - (b * s).float().double()).float()
        b2 = (b.float().double() * c + (a * s).float().double()).float()
        if neox:
            x[:n, :, :half], x[:n, :, half:2 * half] = a2.to(x.dtype), b2.to(x.dtype)
        else:
            x[:n, :, 0::2], x[:n, :, 1::2] = a2.to(x.dtype), b2.to(x.dtype)


def _swapped_pairing(positions, q, k, cos_sin, neox):
    rope_ref.run(positions, q, k, cos_sin, not neox)


def _clamped_positions(positions, q, k, cos_sin, neox):
    rope_ref.run(positions.clamp(0, cos_sin.shape[0] - 1), q, k, cos_sin, neox)


def _float_table_as_model_dtype(positions, q, k, cos_sin, neox):
    rope_ref.run(positions, q, k, cos_sin.to(q.dtype), neox)



WRONG = tuple(WrongWriter(i, _wrong(w), c) for i, w, c in [
    ("fma", _fma_rotation, RopeCase(dtype=torch.float32, num_tokens=9)),
    ("swapped-pairing", _swapped_pairing, RopeCase(num_tokens=5)),
    ("clamped-positions", _clamped_positions, RopeCase(num_tokens=9, bad_positions=3)),
    ("table-rounded-to-bf16", _float_table_as_model_dtype,
     RopeCase(num_tokens=9, dtype=torch.bfloat16)),
])


# --- bad input -------------------------------------------------------------------------------------

ROTARY_BAD = COMMON_BAD + [
    # head_size sizes query first: a mismatch there is head_size's (#41.11), key's after.
    ("head-size-vs-query", lambda a: {"head_size": 8}, ValueError,
     "head_size: expected query's head size 16 (dim 2 of (5, 4, 16)), got 8"),
    ("head-size-vs-flat-query", lambda a: {"query": a["query"].flatten(1), "head_size": 24},
     ValueError, "head_size: expected a divisor of query's row width 64 (shape (5, 64)), got 24"),
    ("query-head-size", lambda a: {"query": a["query"][..., :8]}, ValueError,
     "head_size: expected query's head size 8 (dim 2 of (5, 4, 8)), got 16"),
    ("key-head-size", lambda a: {"key": a["key"][..., :8]}, ValueError,
     "key: expected head size 16 in dim 2, got shape (5, 2, 8)"),
    ("key-flat-size", lambda a: {"key": a["key"].flatten(1)[:, :24]}, ValueError,
     "key: expected [num_tokens, num_heads * 16], got shape (5, 24)"),
    ("key-sparse-heads", lambda a: {"key": torch.cat([a["key"], a["key"]], -1)[..., ::2]},
     ValueError, "key: expected a unit-stride head dim"),
    ("head-size-float", lambda a: {"head_size": 16.0}, TypeError,
     "head_size: expected a positive int, got 16.0"),
    ("key-dtype", lambda a: {"key": a["key"].half()}, ValueError,
     "key: expected the dtype of query (torch.bfloat16), got torch.float16"),
    ("key-short", lambda a: {"key": a["key"][:3]}, ValueError,
     "positions: expected at most key.shape[0] = 3 entries, got 5"),
    ("key-device", lambda a: {"key": meta(a["key"])}, ValueError, "key: expected device cpu"),
    ("implementation", lambda a: {"implementation": "nope"}, ValueError,
     "implementation: expected one of"),
]


BAD = bad_inputs(ROTARY_BAD,
                 lambda: dict(zip(NAMES, make_rope_inputs(VCASE).rotary_args(), strict=True)))

PROVIDER = Provider(
    op=OP,
    call=kvwrite.rotary_embedding,
    build=lambda case, device, seed: make_rope_inputs(case, device, seed).rotary_args(),
    mutates=TENSORS,
    mutated_names=tuple(NAMES[i] for i in TENSORS),
    check=_check,
    skip=_skip,
    **graph_and_compile_cases(fused=False),
    wrong_writers=WRONG,
    bad_inputs=BAD,
)
