"""What the conformance providers of fused_qk_norm_rope and
fused_qk_norm_rope_and_reshape_cache_flash share: the inputs object as the call, the comparison
of every tensor of a call, and the bad-input cases both ops reject (the arithmetic against
independent oracles, CUDA graphs and torch.compile: tests/test_qk_norm_rope.py)."""

from __future__ import annotations

import dataclasses

import torch

from ..conformance import Example, small_tiles
from ..qk_norm import QkNormCase, differences, make_qk_norm_inputs

__all__ = ["VCASE", "NORM_NAMES", "FUSED_NAMES", "COMMON_BAD", "meta", "nan_equal", "tensors_of",
           "with_written", "check_all", "build", "bad", "small_tile_cases"]


def nan_equal(case: QkNormCase) -> bool:
    """Cases whose results hold NaNs (the contract lets each stored NaN be any NaN)."""
    return case.special in ("nan", "inf") or (case.eps == 0 and case.special in ("zeros", "tiny"))


def build(case: QkNormCase, device, seed) -> tuple:
    return (make_qk_norm_inputs(case, device, seed),)


def tensors_of(args: tuple) -> list[torch.Tensor]:
    """Every tensor of the call (compared whole: a write to one only read is caught too)."""
    return list(args[0].tensors().values())


def with_written(args: tuple, copies: list[torch.Tensor]) -> tuple:
    inp = args[0]
    return (dataclasses.replace(inp, **dict(zip(inp.tensors(), copies, strict=True))),)


def check_all(names_of):
    """A check comparing every tensor of the call (``names_of(inputs)`` of them) as the
    per-op tests do (qk_norm.differences: whole allocations, their geometry, NaN rule)."""
    def check(case: QkNormCase, got, want) -> None:
        like = make_qk_norm_inputs(case)
        names = tuple(like.tensors())
        g = dataclasses.replace(like, **dict(zip(names, got, strict=True)))
        w = dataclasses.replace(like, **dict(zip(names, want, strict=True)))
        diff = differences(g, w, nan_equal(case), names_of(w))
        if diff is not None:
            raise AssertionError(f"bytes differ: {diff}")
    return check


def small_tile_cases(**last) -> tuple[Example, ...]:
    """Both ops' small tiles: D = 8, 10 (partial GPT-J rotary), and 16 at 20 tokens, the whole-row
    kernel's smallest call (RowsTuning.min_tokens 17), with ``last``'s fields."""
    return small_tiles(QkNormCase(num_tokens=3, num_q_heads=2, num_k_heads=1), dict(head_size=8),
                       dict(num_tokens=2, head_size=10, rot_dim=4, is_neox=False),
                       dict(num_tokens=20, head_size=16, **last))


VCASE = QkNormCase(num_tokens=5, num_q_heads=4, num_k_heads=2, head_size=16,
                   kv_cache_dtype="fp8", num_blocks=2, query_out="fp8_e4m3")
NORM_NAMES = ("qkv", "num_heads_q", "num_heads_k", "num_heads_v", "head_dim", "eps", "q_weight",
              "k_weight", "cos_sin_cache", "is_neox", "position_ids")
FUSED_NAMES = NORM_NAMES + ("key_cache", "value_cache", "slot_mapping", "k_scale", "v_scale",
                            "kv_cache_dtype")


def meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


COMMON_BAD = [
    ("qkv-not-tensor", lambda a: {"qkv": a["qkv"].tolist()}, TypeError,
     "qkv: expected a torch.Tensor, got list"),
    ("qkv-4d", lambda a: {"qkv": a["qkv"][None]}, ValueError, "qkv: expected 2 dims"),
    ("qkv-int", lambda a: {"qkv": a["qkv"].int()}, ValueError,
     "qkv: expected dtype float16, bfloat16 or float32, got torch.int32"),
    ("qkv-width", lambda a: {"qkv": a["qkv"].flatten(1)[:, :120]}, ValueError,
     "qkv: expected [num_tokens, (num_heads_q + num_heads_k + num_heads_v) * head_dim]"),
    ("qkv-heads-3d", lambda a: {"qkv": a["qkv"][:, :7]}, ValueError,
     "qkv: expected [num_tokens, num_heads_q + num_heads_k + num_heads_v, head_dim]"),
    ("qkv-strided-2d", lambda a: {"qkv": torch.zeros(5, 256, dtype=torch.float16)[:, ::2]},
     ValueError, "qkv: expected a unit stride in dim 1"),
    ("qkv-sparse-heads", lambda a: {"qkv": torch.zeros(5, 8, 32, dtype=torch.float16)[..., ::2]},
     ValueError, "qkv: expected a unit stride in dim 2 (head_dim)"),
    ("num-heads-q-bool", lambda a: {"num_heads_q": True}, TypeError,
     "num_heads_q: expected a Python int, got bool"),
    ("num-heads-k-float", lambda a: {"num_heads_k": 2.0}, TypeError,
     "num_heads_k: expected a Python int, got float"),
    ("num-heads-q-zero", lambda a: {"num_heads_q": 0}, ValueError,
     "num_heads_q: expected an int >= 1, got 0"),
    ("num-heads-k-zero", lambda a: {"num_heads_k": 0}, ValueError,
     "num_heads_k: expected an int >= 1, got 0"),
    ("num-heads-v-negative", lambda a: {"num_heads_v": -1}, ValueError,
     "num_heads_v: expected an int >= 0, got -1"),
    ("num-heads-against-width", lambda a: {"num_heads_q": 3}, ValueError, "qkv: expected"),
    ("head-dim-odd", lambda a: {"head_dim": 15}, ValueError,
     "head_dim: expected an even int in [2, 512], got 15"),
    ("head-dim-large", lambda a: {"head_dim": 514}, ValueError,
     "head_dim: expected an even int in [2, 512], got 514"),
    ("head-dim-bool", lambda a: {"head_dim": False}, TypeError,
     "head_dim: expected a Python int, got bool"),
    ("head-dim-mismatch", lambda a: {"head_dim": 8}, ValueError, "qkv: expected"),
    ("eps-nan", lambda a: {"eps": float("nan")}, ValueError,
     "eps: expected a finite value >= 0, got nan"),
    ("eps-inf", lambda a: {"eps": float("inf")}, ValueError, "eps: expected a finite value"),
    ("eps-negative", lambda a: {"eps": -1e-6}, ValueError, "eps: expected a finite value >= 0"),
    ("eps-str", lambda a: {"eps": "1e-6"}, TypeError,
     "eps: expected a Python float (or int), got str"),
    ("eps-tensor", lambda a: {"eps": torch.tensor(1e-6)}, TypeError,
     "eps: expected a Python float (or int), got Tensor"),
    ("eps-bool", lambda a: {"eps": True}, TypeError, "eps: expected a Python float"),
    ("weight-offset-nan", lambda a: {"weight_offset": float("nan")}, ValueError,
     "weight_offset: expected a finite value, got nan"),
    ("weight-offset-str", lambda a: {"weight_offset": "1"}, TypeError,
     "weight_offset: expected a Python float (or int), got str"),
    ("is-neox-int", lambda a: {"is_neox": 1}, TypeError, "is_neox: expected a bool, got int"),
    ("q-weight-shape", lambda a: {"q_weight": torch.ones(15, dtype=torch.float16)}, ValueError,
     "q_weight: expected shape [head_dim] = [16], got (15,)"),
    ("k-weight-2d", lambda a: {"k_weight": torch.ones(1, 16)}, ValueError,
     "k_weight: expected shape [head_dim] = [16], got (1, 16)"),
    ("q-weight-int", lambda a: {"q_weight": torch.ones(16, dtype=torch.int32)}, ValueError,
     "q_weight: expected dtype float16, bfloat16 or float32, got torch.int32"),
    ("k-weight-strided", lambda a: {"k_weight": torch.ones(32)[::2]}, ValueError,
     "k_weight: expected a unit stride, got stride 2"),
    ("q-weight-device", lambda a: {"q_weight": meta(a["q_weight"])}, ValueError,
     "q_weight: expected device cpu (that of qkv), got meta"),
    ("q-weight-list", lambda a: {"q_weight": [1.0] * 16}, TypeError,
     "q_weight: expected a torch.Tensor, got list"),
    ("q-weight-is-qkv", lambda a: {"q_weight": a["qkv"][0, 0]}, ValueError,
     "q_weight: expected memory apart from qkv's"),
    ("position-ids-2d", lambda a: {"position_ids": a["position_ids"][None]}, ValueError,
     "position_ids: expected 1 dim"),
    ("position-ids-float", lambda a: {"position_ids": a["position_ids"].float()}, ValueError,
     "position_ids: expected dtype int64 or int32, got torch.float32"),
    ("position-ids-strided", lambda a: {"position_ids": a["position_ids"].repeat(2)[::2]},
     ValueError, "position_ids: expected a contiguous tensor"),
    ("position-ids-too-many", lambda a: {"position_ids": torch.zeros(6, dtype=torch.long)},
     ValueError, "position_ids: expected at most qkv.shape[0] = 5 entries, got 6"),
    ("position-ids-device", lambda a: {"position_ids": meta(a["position_ids"])}, ValueError,
     "position_ids: expected device cpu (that of qkv), got meta"),
    ("table-odd-rot", lambda a: {"cos_sin_cache": a["cos_sin_cache"][:, :15].contiguous()},
     ValueError, "cos_sin_cache: expected an even rot_dim in [2, head_size = 16]"),
    ("table-too-wide", lambda a: {"cos_sin_cache": torch.zeros(8, 18)}, ValueError,
     "cos_sin_cache: expected an even rot_dim"),
    ("table-dtype", lambda a: {"cos_sin_cache": a["cos_sin_cache"].double()}, ValueError,
     "cos_sin_cache: expected dtype float32, float16 or bfloat16, got torch.float64"),
    ("table-strided", lambda a: {"cos_sin_cache": torch.zeros(8, 32)[:, ::2]}, ValueError,
     "cos_sin_cache: expected a contiguous tensor"),
    ("table-is-qkv", lambda a: {"cos_sin_cache": a["qkv"].flatten(1)[:, :16]}, ValueError,
     "cos_sin_cache: expected"),
    ("qkv-requires-grad", lambda a: {"qkv": a["qkv"].clone().requires_grad_()}, ValueError,
     "qkv: expected a tensor that does not require grad"),
    ("qkv-overlapping-rows", lambda a: {"qkv": a["qkv"].flatten(1).as_strided((5, 128), (16, 1))},
     ValueError, "qkv: expected every element in its own memory"),
    ("implementation", lambda a: {"implementation": "nope"}, ValueError,
     "implementation: expected one of"),
]


def bad(names, args_of, change):
    """``make`` of a bad-input case: the valid call on VCASE's inputs with ``change`` applied
    (``change`` sees the arguments and every tensor of the inputs)."""
    def make():
        inp = make_qk_norm_inputs(VCASE)
        args = dict(zip(names, args_of(inp), strict=True))
        return (), {**args, **change({**args, **inp.tensors()})}
    return make
