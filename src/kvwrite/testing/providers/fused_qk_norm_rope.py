"""fused_qk_norm_rope for the conformance suite: wrong arithmetic caught, bad input (the norm
and rotation against independent oracles, CUDA graphs and torch.compile:
tests/test_qk_norm_rope.py)."""

from __future__ import annotations

import numpy as np
import torch

import kvwrite
from kvwrite.ops.fused_qk_norm_rope import OP

from ..conformance import BadInput, Provider, WrongWriter
from ..qk_norm import QkNormCase, QkNormInputs
from .qk_norm_common import (
    COMMON_BAD,
    NORM_NAMES,
    bad,
    build,
    check_all,
    small_tile_cases,
    tensors_of,
    with_written,
)


def _call(inp: QkNormInputs, implementation=None) -> None:
    kvwrite.fused_qk_norm_rope(*inp.norm_args(), **inp.norm_kwargs(),
                               implementation=implementation)


# --- wrong arithmetic --------------------------------------------------------------------------------

def variant(inp: QkNormInputs, *, tree: str = "pairwise", root: str = "sqrt",
             order: str = "xr_w", round_after_norm: bool = False, eps_place: str = "inside",
             offset: str = "add") -> None:
    """The reference's arithmetic with one thing changed, in place on qkv."""
    from kvwrite.ops.fused_qk_norm_rope.reference import sum_of_squares
    from kvwrite.ops.rotary_embedding.reference import rotate, store_rotated
    qkv = inp.heads()
    hq, hk = inp.num_heads_q, inp.num_heads_k
    n_rot = inp.position_ids.numel()
    x = qkv[:n_rot, :hq + hk].float()
    if tree == "pairwise":
        ss = sum_of_squares(x)
    else:  # one element after the other
        ss = torch.zeros(x.shape[:2])
        for i in range(x.shape[2]):
            ss = ss + x[..., i] * x[..., i]
    d = x.shape[2]
    eps = float(np.float32(inp.eps))
    m = ss / torch.full_like(ss, d)
    if root == "sqrt":
        sigma = (m + eps).double().sqrt().float()
        r = torch.div(torch.ones_like(sigma), sigma)
    else:  # the correctly rounded reciprocal root, one rounding
        r = (1.0 / (m + eps).double().sqrt()).float()
    if eps_place == "outside":
        sigma = m.double().sqrt().float() + eps
        r = torch.div(torch.ones_like(sigma), sigma)
    r = r[..., None]
    g = torch.cat([inp.q_weight.float().expand(hq, d), inp.k_weight.float().expand(hk, d)])
    if inp.weight_offset and offset == "add":
        g = g + float(np.float32(inp.weight_offset))
    n = x * r * g if order == "xr_w" else x * (r * g)
    if round_after_norm:
        n = n.to(qkv.dtype).float()
    out, valid = rotate(n, inp.position_ids, inp.cos_sin_cache, inp.is_neox)
    store_rotated(qkv[:, :hq + hk], out.to(qkv.dtype), valid)



BROKEN = [
    ("sequential-sum", dict(tree="sequential"), QkNormCase(num_tokens=9, dtype=torch.float32)),
    ("rsqrt", dict(root="rsqrt"), QkNormCase(num_tokens=9, dtype=torch.float32)),
    ("x-times-rw", dict(order="x_rw"), QkNormCase(num_tokens=9, dtype=torch.float32)),
    ("rounded-after-norm", dict(round_after_norm=True), QkNormCase(num_tokens=9)),
    ("eps-outside-root", dict(eps_place="outside"),
     QkNormCase(num_tokens=9, dtype=torch.float32, eps=1e-2)),
    ("no-offset", dict(offset="none"), QkNormCase(num_tokens=9, weight_offset=1.0)),
]
WRONG = tuple(WrongWriter(i, lambda inp, kw=kw: variant(inp, **kw), c) for i, kw, c in BROKEN)


# --- bad input -------------------------------------------------------------------------------------

NORM_BAD = COMMON_BAD + [
    ("forced-heads-float", lambda a: {"forced_token_heads_per_warp": 1.5}, TypeError,
     "forced_token_heads_per_warp: expected an int, got float"),
]

BAD = tuple(BadInput(name, bad(NORM_NAMES, lambda i: i.norm_args(), change), exc, text)
            for name, change, exc, text in NORM_BAD)

PROVIDER = Provider(
    op=OP,
    call=_call,
    public=kvwrite.fused_qk_norm_rope,
    build=build,
    mutates=(),
    mutated_names=(),
    check=check_all(lambda inp: tuple(inp.tensors(cache=False))),
    tensors_of=tensors_of,
    written_of=tensors_of,
    with_written=with_written,
    small_tile_cases=small_tile_cases(),
    wrong_writers=WRONG,
    bad_inputs=BAD,
)
