"""rotary_embedding's memcheck cases (``python -m tools.sanitize``): the cuda implementation on the
GPU against the torch reference on the CPU over the same inputs, query and key compared byte for
byte over their whole allocations. The cases stress the bounds: positions outside the table
(negative, at and past max_position, int32 extremes), rows past T_rot, partial rotation, odd head
sizes, GPT-J pairing, key=None, 2-D inputs and slices of a fused qkv, padded heads, more rows
than one wave."""

from __future__ import annotations

import torch

from kvwrite.testing.rope import RopeCase, make_rope_inputs
from kvwrite.testing.sanitize import SanitizeCase, compare_outputs

__all__ = ["CASES", "cases", "run_case"]

CASES = [
    RopeCase(num_tokens=9, bad_positions=4, extra_rows=3, pos_dtype=torch.int32),
    RopeCase(num_tokens=33, num_q_heads=5, num_heads=3, head_size=46, rot_dim=30, is_neox=False,
             bad_positions=6, fused_qkv=True),
    RopeCase(num_tokens=17, head_size=80, rot_dim=64, no_key=True, flat=True, bad_positions=2,
             dtype=torch.float32, cos_sin_dtype=torch.bfloat16),
    RopeCase(num_tokens=20_000, num_q_heads=4, num_heads=1, head_size=64, bad_positions=5,
             max_position=4096, num_blocks=1300),  # more rows than one resident wave
    # padded heads (vLLM's D = 80 in rows of 144; key's padding breaking 16-byte alignment)
    RopeCase(num_tokens=13, num_q_heads=4, num_heads=2, head_size=80, head_pad=(64, 3, 0, 0),
             bad_positions=2, extra_rows=1, dtype=torch.float16),
]


def run_case(case: RopeCase, device: str = "cuda",
             implementation: str = "cuda") -> str | None:
    """None when ``implementation`` on ``device`` writes the torch reference's bytes (on the
    CPU) for ``case``, else what differs."""
    from kvwrite.ops.rotary_embedding import rotary_embedding

    gpu, cpu = make_rope_inputs(case, device), make_rope_inputs(case, "cpu")
    rotary_embedding(*gpu.rotary_args(), implementation=implementation)
    rotary_embedding(*cpu.rotary_args(), implementation="torch")
    names = ["query"] + ([] if case.no_key else ["key"])
    return compare_outputs({n: getattr(gpu, n) for n in names}, {n: getattr(cpu, n) for n in names})


def cases() -> list[SanitizeCase]:
    return [(c.id, lambda c=c: run_case(c)) for c in CASES]
