"""The gathers' benchmark on the engine (``kvwrite-bench gather``): reading paged caches back into
contiguous rows, the kinds of docs/ops/gather.md side by side at one point:

- ``dequant``: gather_and_maybe_dequant_cache, an MLA cache ``[num_blocks, bs, 576]`` into 16-bit
  rows (fp8: dequantized);
- ``cp``: cp_gather_cache, the same cache's entries copied bit for bit;
- ``upconvert``: cp_gather_and_upconvert_fp8_kv_cache, fp8_ds_mla entries (656 bytes) into
  bfloat16 rows of 576;
- ``flash``: gather_cache_flash, K and V of flash caches ``[num_blocks, bs, H, D]`` (NHD);
- ``indexer``: cp_gather_indexer_k_quant_cache, the DeepSeek-V3.2 indexer cache (``D`` code bytes
  and ``4G`` scale bytes a row).

A point is T rows gathered for ``--num-seqs`` requests: ``even`` splits T evenly (vLLM's
figures: 8 sequences), ``chunked`` gives two long sequences three quarters of the rows and spreads
the rest over short ones (MLA chunked prefill). Each request's blocks come from a shuffled free
list, so each input set (block tables, outputs) reads other cache rows. Caches hold valid values
(fp8 codes without NaN codes, finite fp8_ds_mla tile scales). The check: the implementation and
the torch reference each write copies of the outputs (filled with random bytes first), whose
whole allocations must hold the same bytes. Bytes per call: the rows read from the cache plus the
rows written, and the block-table entries and sequence starts read.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ... import (
    cp_gather_and_upconvert_fp8_kv_cache,
    cp_gather_cache,
    cp_gather_indexer_k_quant_cache,
    formats,
    gather_and_maybe_dequant_cache,
    gather_cache_flash,
)
from ...dtypes import BENCH_DTYPES, MODEL_DTYPES
from ...formats import DS_MLA_L, DS_MLA_P, DS_MLA_PE_OFFSET
from ...ops.cp_gather_and_upconvert_fp8_kv_cache import OP as UPCONVERT
from ...ops.cp_gather_cache import OP as CP
from ...ops.cp_gather_indexer_k_quant_cache import OP as INDEXER
from ...ops.gather_and_maybe_dequant_cache import OP as DEQUANT
from ...ops.gather_cache_flash import OP as FLASH
from .. import engine
from ..engine import OpBench, compare_with_reference, parse_list

__all__ = ["BENCH"]

SEED = 42
KINDS = ("dequant", "cp", "upconvert", "flash", "indexer")
_OPS = {"dequant": DEQUANT, "cp": CP, "upconvert": UPCONVERT, "flash": FLASH, "indexer": INDEXER}


@dataclasses.dataclass(frozen=True)
class Point:
    num_tokens: int
    kv_cache_dtype: str       # auto or fp8 (dequant, cp, flash)
    num_seqs: int
    mix: str                  # even or chunked
    entry: int                # MLA entry elements (dequant, cp)
    block_size: int
    num_blocks: int
    dtype: torch.dtype        # 16-bit output rows
    num_heads: int            # flash
    head_size: int            # flash; the indexer's D
    fp8: bool

    def lens(self) -> list[int]:
        T, B = self.num_tokens, min(self.num_seqs, self.num_tokens)
        if self.mix == "even" or B < 3:
            return [T // B + (r < T % B) for r in range(B)]
        long = 3 * T // 4
        lens = [long // 2 + long % 2, long // 2]
        rest, short = T - long, B - 2
        return lens + [rest // short + (r < rest % short) for r in range(short)]

    def blocks_needed(self) -> int:
        return sum(-(-n // self.block_size) for n in self.lens())


# The formats the gathers read (kvwrite.formats): fp8_ds_mla entries, and the indexer's rows of
# one group of D codes (every scale_fmt's row has this size).
_DS_MLA = formats.lookup("fp8_ds_mla", formats.Family.MLA)
_INDEXER = formats.lookup("float32", formats.Family.INDEXER)


def cache_row_bytes(p: Point) -> dict[str, int]:
    """The bytes of one cache row each kind reads (a flash row is K and V of every head)."""
    mla = formats.lookup(p.kv_cache_dtype, formats.Family.MLA).row_bytes(p.entry, p.dtype)
    flash = formats.lookup(p.kv_cache_dtype).row_bytes(p.head_size, p.dtype)
    return {"dequant": mla, "cp": mla, "upconvert": _DS_MLA.row_bytes(DS_MLA_L + DS_MLA_P),
            "flash": 2 * p.num_heads * flash,
            "indexer": _INDEXER.row_bytes(p.head_size, group=p.head_size)}


def row_bytes(p: Point, kind: str) -> tuple[int, int]:
    """(bytes read from the cache, bytes written) per gathered row."""
    read, e = cache_row_bytes(p)[kind], p.dtype.itemsize
    return {"dequant": (read, p.entry * e), "cp": (read, read),
            "upconvert": (read, (DS_MLA_L + DS_MLA_P) * e),
            "flash": (read, 2 * p.num_heads * p.head_size * e),
            "indexer": (read, read)}[kind]


class GatherBench(OpBench):
    name = "gather"
    summary = "reading caches back: the five gathers (dequant, cp, upconvert, flash, indexer)"
    description = ("Benchmark the gathers that read paged caches back into contiguous rows: "
                   "gather_and_maybe_dequant_cache, cp_gather_cache, "
                   "cp_gather_and_upconvert_fp8_kv_cache, gather_cache_flash and "
                   "cp_gather_indexer_k_quant_cache, for MLA chunked prefill's sequence sets.")
    op = FLASH
    kinds = KINDS
    ops_of_kind = {kind: (op,) for kind, op in _OPS.items()}
    defaults = {"num_tokens": "1024,8192,16384,65536", "time_budget": 0.25}
    cpu_defaults = {"num_blocks": 64, "num_tokens": "16,256", **engine.CPU_TIMING, "num_heads": 2}
    columns = (("num_tokens", "num_tokens"), ("kv_cache_dtype", "cache"), ("mix", "mix"))
    always_columns = ("num_tokens",)

    def __init__(self) -> None:
        self._caches: dict = {}

    def add_flags(self, p) -> None:
        g = p.add_argument_group("the points")
        g.add_argument("--kv-cache-dtypes", default="auto",
                       help="comma list of auto, fp8 (the caches of dequant, cp and flash; "
                            "upconvert reads fp8_ds_mla, indexer its own) (default: auto)")
        g.add_argument("--num-seqs", type=int, default=8, help="requests (default: 8)")
        g.add_argument("--mix", default="even",
                       help="comma list of even (T split evenly) and chunked (two long "
                            "sequences hold 3/4 of the rows, short ones the rest) "
                            "(default: even)")
        g.add_argument("--entry", type=int, default=576,
                       help="MLA entry elements of dequant and cp (default: 576)")
        engine.add_cache_flags(g, block_size=64, num_blocks=2048, dtype_help="the 16-bit rows",
                        dtypes=[d for d in BENCH_DTYPES if d != "float"])
        g.add_argument("--num-heads", type=int, default=8, help="flash: KV heads (default: 8)")
        g.add_argument("--head-size", type=int, default=128,
                       help="flash's D and the indexer's D (default: 128)")

    def configure(self, args, device) -> None:
        engine.require_positive(args, ("num_seqs", "entry", "block_size", "num_blocks", "num_heads",
                                "head_size"))
        args.kv_list = parse_list(args.kv_cache_dtypes, "--kv-cache-dtypes", ["auto", "fp8"])
        args.mix_list = parse_list(args.mix, "--mix", ["even", "chunked"])

    def points(self, args) -> list:
        return [Point(t, kv, args.num_seqs, mix, args.entry, args.block_size, args.num_blocks,
                      MODEL_DTYPES[args.dtype], args.num_heads, args.head_size, kv == "fp8")
                for kv in args.kv_list for mix in args.mix_list for t in args.token_counts]

    def params(self, p: Point) -> dict:
        return dict(kv_cache_dtype=p.kv_cache_dtype, mix=p.mix, num_seqs=p.num_seqs,
                    entry=p.entry, block_size=p.block_size, num_blocks=p.num_blocks,
                    dtype=str(p.dtype).removeprefix("torch."), num_heads=p.num_heads,
                    head_size=p.head_size)

    def header(self, args, points) -> list[str]:
        return [f"shape: MLA entry {args.entry}, flash H={args.num_heads} D={args.head_size}, "
                f"indexer D={args.head_size}; block_size={args.block_size} "
                f"num_blocks={args.num_blocks} dtype={args.dtype}; {args.num_seqs} requests "
                f"({args.mix})",
                "bytes per call = T*(cache row bytes + output row bytes) + the block-table "
                "entries and sequence starts read"]

    def set_bytes(self, p: Point, kind: str) -> int:
        return p.num_tokens * sum(row_bytes(p, kind))

    def block_bytes(self, p: Point) -> int:
        rows = cache_row_bytes(p)  # a slot of each cache: dequant's and cp's is one
        return p.block_size * (rows["dequant"] + rows["upconvert"] + rows["flash"]
                               + rows["indexer"])

    def temp_bytes(self, p: Point) -> int:
        return 2 * max(self.set_bytes(p, k) for k in KINDS)  # the check's output copies

    def bytes(self, p: Point, kind: str) -> int:
        index = 4 * (p.blocks_needed() + len(p.lens()) + 1)
        return self.set_bytes(p, kind) + index

    def skip_reason(self, p: Point) -> str | None:
        if p.blocks_needed() > p.num_blocks:
            return (f"the {len(p.lens())} requests' {p.num_tokens} rows need "
                    f"{p.blocks_needed()} blocks, the cache has {p.num_blocks}: raise "
                    f"--num-blocks or lower --num-tokens")
        return None

    def _cache(self, p: Point, kind: str, device) -> tuple:
        key = (kind, p.kv_cache_dtype, p.entry, p.block_size, p.num_blocks, p.dtype,
               p.num_heads, p.head_size, device)
        if key not in self._caches:
            self._caches[key] = _make_cache(p, kind, device)
        return self._caches[key]

    def prepare(self, p: Point, count: int, device):
        gen = torch.Generator().manual_seed(SEED)
        lens = p.lens()
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
        per = max(-(-n // p.block_size) for n in lens)
        sets = []
        for _ in range(count):
            free = torch.randperm(p.num_blocks, generator=gen).tolist()
            table = torch.full((len(lens), per), -1, dtype=torch.int32)
            for r, n in enumerate(lens):
                need = -(-n // p.block_size)
                table[r, :need] = torch.tensor(free[:need], dtype=torch.int32)
                free = free[need:]
            t2s = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32),
                                          torch.tensor(lens))
            sets.append({"block_table": table.to(device), "cu_seq_lens": cu.to(device),
                         "token_to_seq": t2s.to(device)})
        return p, sets, device

    def _outputs(self, p: Point, kind: str, device) -> dict[str, torch.Tensor]:
        T, e = p.num_tokens, p.dtype
        if kind == "dequant":
            return {"dst": torch.empty(T, p.entry, dtype=e, device=device)}
        if kind == "cp":
            return {"dst": torch.empty(T, p.entry, dtype=torch.uint8 if p.fp8 else e,
                                       device=device)}
        if kind == "upconvert":
            return {"dst": torch.empty(T, DS_MLA_L + 64, dtype=e, device=device)}
        if kind == "flash":
            return {n: torch.empty(T, p.num_heads, p.head_size, dtype=e, device=device)
                    for n in ("key_out", "value_out")}
        return {"dst_k": torch.empty(T, p.head_size, dtype=torch.uint8, device=device),
                "dst_scale": torch.empty(T, 4, dtype=torch.uint8, device=device)}

    def _writer(self, p: Point, kind: str, s: dict, cache: tuple, impl: str):
        bt, cu = s["block_table"], s["cu_seq_lens"]
        B = cu.numel() - 1
        kv = "fp8" if p.fp8 else "auto"
        if kind == "dequant":
            src, scale = cache
            t2s = s["token_to_seq"]
            return lambda o: gather_and_maybe_dequant_cache(src, o["dst"], bt, cu, t2s,
                                                            p.num_tokens, kv, scale,
                                                            implementation=impl)
        if kind == "cp":
            src = cache[0]
            return lambda o: cp_gather_cache(src, o["dst"], bt, cu, B, implementation=impl)
        if kind == "upconvert":
            src = cache[0]
            return lambda o: cp_gather_and_upconvert_fp8_kv_cache(src, o["dst"], bt, cu[:-1], B,
                                                                  implementation=impl)
        if kind == "flash":
            kc, vc, ks, vs = cache
            return lambda o: gather_cache_flash(kc, vc, o["key_out"], o["value_out"], bt, cu, kv,
                                                ks, vs, implementation=impl)
        src = cache[0]
        return lambda o: cp_gather_indexer_k_quant_cache(src, o["dst_k"], o["dst_scale"], bt, cu,
                                                         implementation=impl)

    def check(self, ctx, kind, impl) -> str | None:
        p, sets, device = ctx
        cache = self._cache(p, kind, device)
        outs = self._outputs(p, kind, device)
        gen = torch.Generator(device=device).manual_seed(1)
        for t in outs.values():  # rows a call must not write keep these bytes
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8, generator=gen,
                                                    device=device))
        nan = {n: t.dtype for n, t in outs.items() if t.dtype.is_floating_point}
        return compare_with_reference(self._writer(p, kind, sets[0], cache, impl),
                                      self._writer(p, kind, sets[0], cache, "torch"), outs, nan)

    def call(self, ctx, kind, impl):
        p, sets, device = ctx
        cache = self._cache(p, kind, device)
        writers = []
        for s in sets:
            outs = self._outputs(p, kind, device)
            w = self._writer(p, kind, s, cache, impl)
            writers.append((w, outs))

        def call(i: int) -> None:
            w, outs = writers[i % len(writers)]
            w(outs)
        return call

    def release(self) -> None:
        self._caches.clear()


def _valid_fp8_bytes(shape, gen, device) -> torch.Tensor:
    """Random e4m3 codes without the NaN codes (0x7F, 0xFF)."""
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    b[(b & 0x7F) == 0x7F] = 0x3C
    return b.to(device)


def _make_cache(p: Point, kind: str, device) -> tuple:
    gen = torch.Generator().manual_seed(SEED)
    nb, bs = p.num_blocks, p.block_size
    if kind in ("dequant", "cp"):
        if p.fp8:
            src = _valid_fp8_bytes((nb, bs, p.entry), gen, device)
        else:
            src = torch.randn(nb, bs, p.entry, generator=gen).to(p.dtype).to(device)
        scale = torch.tensor([0.37], dtype=torch.float32, device=device)
        return src, scale
    if kind == "upconvert":
        src = _valid_fp8_bytes((nb, bs, _DS_MLA.entry_bytes), gen, "cpu")
        scales = torch.rand(nb, bs, 4, generator=gen) * 0.01 + 1e-4
        src[..., DS_MLA_L:DS_MLA_PE_OFFSET] = scales.view(torch.uint8)
        pe = torch.randn(nb, bs, 64, generator=gen).to(p.dtype)
        src[..., DS_MLA_PE_OFFSET:] = pe.view(torch.uint8)
        return (src.to(device),)
    if kind == "flash":
        shape = (nb, bs, p.num_heads, p.head_size)
        if p.fp8:
            kc, vc = _valid_fp8_bytes(shape, gen, device), _valid_fp8_bytes(shape, gen, device)
        else:
            kc = torch.randn(*shape, generator=gen).to(p.dtype).to(device)
            vc = torch.randn(*shape, generator=gen).to(p.dtype).to(device)
        ks = torch.tensor([0.05], dtype=torch.float32, device=device)
        vs = torch.tensor([0.04], dtype=torch.float32, device=device)
        return kc, vc, ks, vs
    width = cache_row_bytes(p)["indexer"]
    return (torch.randint(0, 256, (nb, bs, width), dtype=torch.uint8, generator=gen)
            .to(device),)


BENCH = GatherBench()
