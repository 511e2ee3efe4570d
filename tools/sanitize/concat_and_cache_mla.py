"""concat_and_cache_mla's memcheck cases (``python -m tools.sanitize``): the cuda implementation on
the GPU against the torch reference on the CPU over the same inputs, the whole cache allocation
compared byte for byte. The cases stress the bounds in every mode: padding and out-of-range
slots, int32 slots, rows past T, k_pe a slice of the latent projection, padded and unaligned
cache entries, a slot-major cache, odd kv_lora_rank and pe_dim (narrow accesses), fp8_ds_mla
special tiles under both tile scale rules, NoPE rows (k_pe [T, 0]), more tokens than one wave."""

from __future__ import annotations

import torch

from kvwrite.testing.mla import MlaCase, make_mla_inputs, mla_differing_bytes
from kvwrite.testing.sanitize import SanitizeCase

__all__ = ["CASES", "cases", "run_case"]

CASES = [
    MlaCase(num_tokens=9, padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32,
            extra_rows=2),
    MlaCase(num_tokens=13, kv_lora_rank=46, pe_dim=10, kv_cache_dtype="fp8",
            latent_slices=True, latent_pad=3, cache_pad=5, cache_offset=1, out_of_range_slots=3),
    MlaCase(num_tokens=11, kv_cache_dtype="fp8_e5m2", fp8_storage="float8",
            cache_transposed=True, padding_slots=2, dtype=torch.float32),
    MlaCase(num_tokens=17, kv_cache_dtype="fp8_ds_mla", latent_slices=True, cache_pad=8,
            padding_slots=3, out_of_range_slots=3, special_values=True),
    MlaCase(num_tokens=9, kv_cache_dtype="fp8_ds_mla", cache_offset=2, cache_pad=6,
            dtype=torch.float16, out_of_range_slots=2),  # unaligned entries: narrow accesses
    MlaCase(num_tokens=17, kv_cache_dtype="fp8_ds_mla", ds_mla_scale="amax", cache_pad=8,
            padding_slots=3, out_of_range_slots=3, special_values=True),
    MlaCase(num_tokens=9, kv_cache_dtype="fp8_ds_mla", pe_dim=0, latent_slices=True,
            cache_offset=2, cache_pad=6, out_of_range_slots=2, special_values=True),  # NoPE
    MlaCase(num_tokens=30_000, kv_cache_dtype="fp8_ds_mla", num_blocks=2000,
            padding_slots=40, out_of_range_slots=40),  # the large-call (bracket) build
    MlaCase(num_tokens=30_000, kv_cache_dtype="fp8_ds_mla", ds_mla_scale="amax", pe_dim=0,
            num_blocks=2000, padding_slots=40, out_of_range_slots=40),
    MlaCase(num_tokens=30_000, num_blocks=2000, padding_slots=40, out_of_range_slots=40),
]


def run_case(case: MlaCase, device: str = "cuda",
             implementation: str = "cuda") -> str | None:
    """None when ``implementation`` on ``device`` writes the torch reference's bytes (on the
    CPU) for ``case``, else what differs."""
    from kvwrite.ops.concat_and_cache_mla import concat_and_cache_mla

    gpu, cpu = make_mla_inputs(case, device), make_mla_inputs(case, "cpu")
    concat_and_cache_mla(*gpu.args(), **gpu.kwargs(), implementation=implementation)
    concat_and_cache_mla(*cpu.args(), **cpu.kwargs(), implementation="torch")
    if device != "cpu":
        torch.cuda.synchronize()
    bad = mla_differing_bytes(gpu.kv_cache, cpu.kv_cache, case.mode)  # NaN-aware in fp8 codes
    if bool(bad.any()):
        first = torch.nonzero(bad).flatten()[:8].tolist()
        return f"kv_cache: {int(bad.sum())} bytes differ; first at byte offsets {first}"
    return None


def cases() -> list[SanitizeCase]:
    return [(c.id, lambda c=c: run_case(c)) for c in CASES]
