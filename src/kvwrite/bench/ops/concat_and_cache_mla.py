"""concat_and_cache_mla's benchmark on the engine: vLLM's benchmark_concat_and_cache_mla.py (its
flags, sweep num_tokens 2^0..2^16 and table) with fp8_e4m3, fp8_e5m2 and fp8_ds_mla added;
fp8_ds_mla takes its tile scale rules (``--ds-mla-scales pow2,amax``) and NoPE rows
(``--pe-dim 0``).

Each point follows vLLM's recipe: every RNG seeded with 42, ``kv_c`` and ``k_pe`` from
``torch.randn`` (with ``--strided``, ``k_pe`` is ``latent[:, L:]`` of a ``[T, L + P]`` randn
latent), unique slots from ``random.sample``, a zeroed ``[num_blocks, block_size, E]`` cache and
``scale = 0.1``; further input sets (for L2 rotation) continue the same random streams. The check
runs the implementation on a copy of the cache and compares every byte with the reference's.
Bytes per call: ``n*(L+P)*in_bytes + n*entry_bytes + T*8`` (n = T less the padding).
:func:`run_benchmark` is vLLM's function.
"""

from __future__ import annotations

import dataclasses

import torch

from ... import registry
from ...dtypes import MODEL_DTYPES
from ...ops.concat_and_cache_mla import (
    OP,
    DsMlaScale,
    MlaMode,
    create_mla_cache,
    parse_mla_mode,
    validate,
)
from ...ops.concat_and_cache_mla import reference as torch_ref
from ...ops.concat_and_cache_mla.op import DEFAULT_DS_MLA_SCALE, parse_ds_mla_scale
from ...testing.mla import mla_differing_bytes
from ...testing.slots import SlotPattern
from .. import engine, timing
from ..engine import SlotsBench, parse_list, slot_pattern
from ..workload import slot_sets

__all__ = ["BENCH", "run_benchmark", "make_sets", "bytes_moved"]

SCALE = 0.1
KV_CACHE_DTYPES = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"]


def entry_bytes(mode: MlaMode, L: int, P: int, dtype: torch.dtype) -> int:
    """Bytes of one cache entry: the mode's format's row for L + P values (kvwrite.formats)."""
    return mode.format.row_bytes(L + P, dtype)


def bytes_moved(num_tokens: int, L: int, P: int, dtype: torch.dtype, mode: MlaMode,
                num_padding: int = 0) -> int:
    """Bytes one call reads and writes: the real tokens' inputs and entries, and the int64 slots
    of all ``num_tokens`` (padding slots are read; their tokens move nothing else)."""
    n = num_tokens - num_padding
    return n * ((L + P) * dtype.itemsize + entry_bytes(mode, L, P, dtype)) + num_tokens * 8


@dataclasses.dataclass
class InputSet:
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    slot_mapping: torch.Tensor


def make_sets(num_tokens: int, L: int, P: int, dtype: torch.dtype, strided: bool, num_blocks: int,
              block_size: int, count: int, device, pattern: SlotPattern | None = None
              ) -> list[InputSet]:
    """``count`` input sets with ``pattern``'s slots; with the default pattern (random, no
    padding) set 0 is vLLM's benchmark input. Raises ValueError where the pattern does not fit."""
    num_slots = num_blocks * block_size
    if num_tokens > num_slots:
        raise ValueError(f"num_tokens: expected at most num_blocks * block_size = {num_slots}, "
                         f"got {num_tokens}")

    def rows() -> tuple[torch.Tensor, torch.Tensor]:
        if strided:
            latent = torch.randn(num_tokens, L + P, dtype=dtype, device=device)
            kv_c = torch.randn(num_tokens, L, dtype=dtype, device=device)
            return kv_c, latent[:, L:]
        return (torch.randn(num_tokens, L, dtype=dtype, device=device),
                torch.randn(num_tokens, P, dtype=dtype, device=device))

    return [InputSet(*s) for s in slot_sets(pattern or SlotPattern(), num_tokens, num_blocks,
                                            block_size, count, device, rows)]


@dataclasses.dataclass(frozen=True)
class Point:
    num_tokens: int
    kv_lora_rank: int
    pe_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    mode: MlaMode
    kv_cache_dtype: str
    strided: bool
    slots: SlotPattern
    ds_mla_scale: DsMlaScale = DEFAULT_DS_MLA_SCALE


class ConcatAndCacheMlaBench(SlotsBench):
    name = OP
    summary = "the MLA latent cache write"
    description = ("Benchmark concat_and_cache_mla (the MLA latent cache write): vLLM's flags, "
                   "sweep and table, plus device timing, several implementations side by side, "
                   "bandwidth, a check before timing, JSON/CSV and plots.")
    op = OP
    defaults = {"time_budget": 0.25}
    cpu_defaults = {"num_blocks": 16, "block_size": 16, "num_tokens": "1:64", **engine.CPU_TIMING}
    columns = (("num_tokens", "num_tokens"), ("kv_cache_dtype", "kv_cache_dtype"),
               ("ds_mla_scale", "ds_mla_scale"))

    def add_flags(self, p) -> None:
        g = p.add_argument_group("vLLM's flags (same defaults; fp8_e4m3, fp8_e5m2, fp8_ds_mla "
                                 "added)")
        g.add_argument("--kv-lora-rank", type=int, default=512, help="L (default: 512)")
        g.add_argument("--pe-dim", type=int, default=64,
                       help="P (default: 64; 0 with fp8_ds_mla: NoPE layers)")
        engine.add_cache_flags(g, block_size=64, num_blocks=2048, dtype_help="kv_c/k_pe dtype")
        g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="(default: auto)")
        g.add_argument("--strided", action="store_true",
                       help="pass k_pe as a slice of the latent projection, as the model does")
        g.add_argument("--ds-mla-scales", default=DEFAULT_DS_MLA_SCALE.value,
                       help="fp8_ds_mla: comma list of tile scale rules, pow2 (vLLM 0.33) and "
                            f"amax (earlier vLLM) (default: {DEFAULT_DS_MLA_SCALE.value})")

    def configure(self, args, device) -> None:
        mode = parse_mla_mode(args.kv_cache_dtype)
        nope = mode is MlaMode.FP8_DS_MLA and args.pe_dim == 0  # --pe-dim 0: NoPE layers
        engine.require_positive(args, ("kv_lora_rank", *(() if nope else ("pe_dim",)), "block_size",
                                "num_blocks"))
        if mode is MlaMode.FP8_DS_MLA and (args.kv_lora_rank != 512 or args.pe_dim not in (64, 0)):
            raise ValueError(f"--kv-cache-dtype fp8_ds_mla: needs --kv-lora-rank 512 and --pe-dim "
                             f"64 (or 0: NoPE), got {args.kv_lora_rank} and {args.pe_dim}")
        if mode is MlaMode.FP8_DS_MLA and args.dtype == "float":
            raise ValueError("--kv-cache-dtype fp8_ds_mla: needs --dtype half or bfloat16, got "
                             "float")
        rules = parse_list(args.ds_mla_scales, "--ds-mla-scales", [r.value for r in DsMlaScale])
        if mode is not MlaMode.FP8_DS_MLA and rules != [DEFAULT_DS_MLA_SCALE.value]:
            raise ValueError(f"--ds-mla-scales: only --kv-cache-dtype fp8_ds_mla has tile scales, "
                             f"got {args.ds_mla_scales!r} with --kv-cache-dtype "
                             f"{args.kv_cache_dtype}")
        args.rule_list = [parse_ds_mla_scale(r, mode) for r in rules]
        args.pattern = slot_pattern(args)

    def points(self, args) -> list:
        mode = parse_mla_mode(args.kv_cache_dtype)
        return [Point(t, args.kv_lora_rank, args.pe_dim, args.block_size, args.num_blocks,
                      MODEL_DTYPES[args.dtype], mode, args.kv_cache_dtype, args.strided,
                      args.pattern, rule) for rule in args.rule_list for t in args.token_counts]

    def params(self, p: Point) -> dict:
        return dict(layout="strided" if p.strided else "contiguous",
                    dtype=str(p.dtype).removeprefix("torch."), kv_cache_dtype=p.kv_cache_dtype,
                    kv_lora_rank=p.kv_lora_rank, pe_dim=p.pe_dim, block_size=p.block_size,
                    num_blocks=p.num_blocks, **engine.slot_params(p.slots),
                    # fp8_ds_mla's tile scale rule (no other mode has one)
                    **({"ds_mla_scale": p.ds_mla_scale.value}
                       if p.mode is MlaMode.FP8_DS_MLA else {}))

    def header(self, args, points) -> list[str]:
        return [f"shape: kv_lora_rank={args.kv_lora_rank} pe_dim={args.pe_dim} "
                f"block_size={args.block_size} num_blocks={args.num_blocks} dtype={args.dtype} "
                f"kv_cache_dtype={args.kv_cache_dtype} strided={args.strided}"
                + (f" ds_mla_scales={args.ds_mla_scales}"
                   if parse_mla_mode(args.kv_cache_dtype) is MlaMode.FP8_DS_MLA else ""),
                engine.slots_line(args.pattern, points, args.num_blocks, args.block_size),
                "bytes per call = n*(L+P)*in_bytes + n*entry_bytes + T*8 (n = T less the "
                "padding)"]

    def title(self, args, cfg) -> str:
        return (f"concat_and_cache_mla: dtype={args.dtype} kv_cache_dtype={args.kv_cache_dtype} "
                f"kv_lora_rank={args.kv_lora_rank} pe_dim={args.pe_dim} strided={args.strided}")

    def set_bytes(self, p: Point, kind: str) -> int:
        return p.num_tokens * ((p.kv_lora_rank + p.pe_dim) * p.dtype.itemsize + 8)

    def block_bytes(self, p: Point) -> int:
        # The cache and the check's two copies of it.
        return 3 * p.block_size * entry_bytes(p.mode, p.kv_lora_rank, p.pe_dim, p.dtype)

    def bytes(self, p: Point, kind: str) -> int:
        return bytes_moved(p.num_tokens, p.kv_lora_rank, p.pe_dim, p.dtype, p.mode,
                           p.slots.num_padding(p.num_tokens))

    def prepare(self, p: Point, count: int, device):
        with engine.skip_unless_fits():
            sets = make_sets(p.num_tokens, p.kv_lora_rank, p.pe_dim, p.dtype, p.strided,
                             p.num_blocks, p.block_size, count, device, p.slots)
        cache = create_mla_cache(p.num_blocks, p.block_size, p.kv_lora_rank, p.pe_dim, p.mode,
                                 p.dtype, device)
        scale = torch.tensor([SCALE], dtype=torch.float32, device=device)
        validate(sets[0].kv_c, sets[0].k_pe, cache, sets[0].slot_mapping, p.mode, scale,
                 ds_mla_scale=p.ds_mla_scale)
        return p, cache, sets, scale if p.mode.uses_scale else None

    def unsupported(self, ctx, kind, impl) -> str | None:
        p, cache, sets, _ = ctx
        return registry.get(OP, impl).unsupported(sets[0].kv_c, cache, p.mode)

    def check(self, ctx, kind, impl) -> str | None:
        """Run ``impl`` once on a copy of the cache and compare every byte with the
        reference's."""
        p, cache, sets, scale = ctx
        s = sets[0]
        want = cache.clone()
        torch_ref.run(s.kv_c, s.k_pe, want, s.slot_mapping, p.mode, scale,
                      ds_scale=p.ds_mla_scale)
        got = cache.clone()
        registry.get(OP, impl).run(s.kv_c, s.k_pe, got, s.slot_mapping, p.mode, scale,
                                   ds_scale=p.ds_mla_scale)
        if torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            return None
        bad = mla_differing_bytes(got, want, p.mode)  # NaN-aware in the fp8 codes only
        if not bool(bad.any()):
            return None
        first = int(torch.nonzero(bad)[0])
        e = cache.stride(1) * cache.element_size()
        return f"{int(bad.sum())} cache bytes differ from the reference (first: slot {first // e})"

    def call(self, ctx, kind, impl):
        p, cache, sets, scale = ctx
        run = registry.get(OP, impl).run
        rule = p.ds_mla_scale

        def call(i: int) -> None:
            s = sets[i % len(sets)]
            run(s.kv_c, s.k_pe, cache, s.slot_mapping, p.mode, scale, ds_scale=rule)
        return call


BENCH = ConcatAndCacheMlaBench()


def run_benchmark(num_tokens: int, kv_lora_rank: int, pe_dim: int, block_size: int,
                  num_blocks: int, dtype: torch.dtype, kv_cache_dtype: str, strided: bool,
                  device: str = "cuda", implementation: str = "cuda") -> float:
    """vLLM's function: the median latency in microseconds of one cache write (vLLM's inputs,
    the same inputs every call, a CUDA graph of 20 calls timed with CUDA events)."""
    mode = parse_mla_mode(kv_cache_dtype)
    dev = torch.device(device)
    dtype = MODEL_DTYPES[dtype] if isinstance(dtype, str) else dtype
    (s,) = make_sets(num_tokens, kv_lora_rank, pe_dim, dtype, strided, num_blocks, block_size, 1,
                     dev)
    cache = create_mla_cache(num_blocks, block_size, kv_lora_rank, pe_dim, mode, dtype, dev)
    scale = torch.tensor([SCALE], dtype=torch.float32, device=dev)
    validate(s.kv_c, s.k_pe, cache, s.slot_mapping, mode, scale)
    run = registry.get(OP, implementation).run
    sc = scale if mode.uses_scale else None

    def call(i: int) -> None:
        run(s.kv_c, s.k_pe, cache, s.slot_mapping, mode, sc)

    if dev.type == "cpu":
        return timing.time_cpu(call, 20, 20, budget_s=0.2).median * 1e6
    return timing.time_device(call, 20, 100, graph=True, budget_s=0.2).median * 1e6
