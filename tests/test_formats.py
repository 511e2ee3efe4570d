"""The format table (kvwrite.formats): every format's row bytes against the SPEC's sizes and the
allocators' actual tensors, lookup by every spelling, unknown spellings refused naming the
argument, and the old homes of its facts agreeing with it."""

from __future__ import annotations

import pytest
import torch

import kvwrite
from kvwrite import dtypes, formats
from kvwrite.formats import FORMATS, Family, Granularity, Placement, lookup
from kvwrite.layouts import create_kv_caches_with_random_flash
from kvwrite.ops.concat_and_cache_mla import op as mla_op
from kvwrite.ops.indexer_k_quant_and_cache.op import parse_scale_fmt
from kvwrite.ops.mx_kv_write import create_mx_caches
from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant.op import parse_kv_quant_mode
from kvwrite.testing.turboquant import TqCase, make_tq_inputs

NB, BS, H = 3, 8, 2
HEAD_SIZES = (16, 64, 128, 256)
FMT_IDS = [f"{f.family.name}-{f.name}" for f in FORMATS]


def spec_row_bytes(f: formats.Format, d: int, input_dtype: torch.dtype, group: int) -> int:
    """Bytes of one row as the SPEC states them (written out here, independently of the table)."""
    key, g = (f.family, f.name), group or 1
    if f.name == "auto":
        return d * input_dtype.itemsize
    return {
        (Family.FLASH, "float16"): 2 * d, (Family.FLASH, "bfloat16"): 2 * d,
        (Family.FLASH, "float32"): 4 * d,
        (Family.FLASH, "fp8_e4m3"): d, (Family.FLASH, "fp8_e5m2"): d,          # §1.1
        (Family.FLASH, "nvfp4"): d // 2 + d // 16,                             # §6.2
        (Family.FLASH, "nvfp4_4over6"): d // 2 + d // 16,
        (Family.FLASH, "mxfp8"): d + d // 32,                                 # §10.3
        (Family.FLASH, "mxfp4"): d // 2 + d // 32,
        (Family.PER_TOKEN_HEAD, "int8_per_token_head"): d + 4,                 # §5: Dq + 4
        (Family.PER_TOKEN_HEAD, "fp8_per_token_head"): d + 4,
        (Family.PER_TOKEN_HEAD, "int4_per_token_head"): d // 2 + 4,
        (Family.MLA, "fp8_e4m3"): d, (Family.MLA, "fp8_e5m2"): d,              # §4
        (Family.MLA, "fp8_ds_mla"): 656,
        (Family.INDEXER, "ue8m0"): d + 4 * (d // g),                           # §8.6
        (Family.INDEXER, "mxfp8"): d + 4 * (d // 128),
        (Family.INDEXER, "float32"): d + 4 * (d // g),
        # §10.1: key part (KPS), value codes, fp16 scale and zero.
        (Family.TURBOQUANT, "turboquant_k8v4"): d + d // 2 + 4,
        (Family.TURBOQUANT, "turboquant_4bit_nc"): d // 2 + 2 + d // 2 + 4,
        (Family.TURBOQUANT, "turboquant_k3v4_nc"): 3 * d // 8 + 2 + d // 2 + 4,
        (Family.TURBOQUANT, "turboquant_3bit_nc"): 3 * d // 8 + 2 + 3 * d // 8 + 4,
    }[key]


def allocated_row_bytes(f: formats.Format, d: int, input_dtype: torch.dtype, group: int) -> int:
    """Bytes of one row of a cache the format's allocator makes, from the tensors' shapes and
    strides: codes plus the scales stored with the row."""
    if f.family is Family.FLASH and f.name.startswith("mx"):
        # Data caches and scale caches: their own allocations, or SGLang's inline rows (the
        # scale caches view each row's tail).
        kc, _, ks, _ = create_mx_caches(NB, BS, H, d, f.name, device="cpu")
        separate = kc.stride(2) + ks.stride(2)
        kc, _, ks, _ = create_mx_caches(NB, BS, H, d, f.name, inline=True, device="cpu")
        assert ks.data_ptr() - kc.data_ptr() == kc.shape[3]
        assert separate == kc.stride(2)
        return kc.stride(2)
    if f.family is Family.FLASH:
        kc, vc = create_kv_caches_with_random_flash(NB, BS, 1, H, d, f.spellings[0],
                                                    model_dtype=input_dtype, seed=0,
                                                    device="cpu")
        kc, vc = kc[0], vc[0]
        # NHD, K then V of a block: one (token, head) row is the head stride, and a block side
        # (data and scale regions of vLLM's NVFP4 page too) is block_size * H rows.
        es = kc.element_size()
        assert kc.stride(2) * es == kc.shape[3] * es
        assert (vc.data_ptr() - kc.data_ptr()) == BS * H * kc.stride(2) * es
        return kc.stride(2) * es
    if f.family is Family.PER_TOKEN_HEAD:
        sizes = set()
        for alloc in ("packed", "interleaved", "separate"):
            kc, vc, ks, vs = kvwrite.create_per_token_head_caches(
                NB, BS, H, d, f.name, kv_alloc=alloc, device="cpu")
            if alloc == "packed":      # each (token, head): K codes, K scale, V codes, V scale
                sizes.add(kc.stride(2) * kc.element_size() // 2)
                assert ks.data_ptr() - kc.data_ptr() == kc.shape[3] * kc.element_size()
            elif alloc == "interleaved":  # each row: codes then scale
                sizes.add(kc.stride(2) * kc.element_size())
                assert ks.data_ptr() - kc.data_ptr() == kc.shape[3] * kc.element_size()
            else:                       # codes and scales in their own tensors
                sizes.add(kc.shape[3] * kc.element_size() + ks.element_size())
                assert ks.shape == kc.shape[:3]
        assert len(sizes) == 1, sizes
        return sizes.pop()
    if f.family is Family.MLA:
        L, P = (formats.DS_MLA_L, formats.DS_MLA_P) if f.name == "fp8_ds_mla" else (d - 8, 8)
        cache = kvwrite.create_mla_cache(NB, BS, L, P, f.name, input_dtype, device="cpu")
        assert cache.stride(1) == cache.shape[2]
        return cache.shape[2] * cache.element_size()
    if f.family is Family.TURBOQUANT:  # vLLM's allocation, rows of slot_size_aligned bytes
        inp = make_tq_inputs(TqCase(kv_cache_dtype=f.name, head_size=d, num_heads=H,
                                    num_blocks=NB, block_size=BS, layout="HND"))
        return inp.kv_cache.stride(1)
    cache = kvwrite.create_indexer_k_cache(NB, BS, d, group, device="cpu")
    return cache.stride(1) * cache.element_size()


def _cases(f: formats.Format):
    """(head size, input dtype, group) cases the format takes."""
    for d in HEAD_SIZES:
        for dt in (torch.bfloat16, torch.float32):
            if f.name == "fp8_ds_mla":
                if dt is torch.bfloat16:
                    yield formats.DS_MLA_L + formats.DS_MLA_P, dt, 0
                continue
            if d % f.head_size_multiple:
                continue
            if f.family is Family.INDEXER:
                groups = (128,) if f.name == "mxfp8" else (d, 16)
                for g in groups:
                    if d % g == 0:
                        yield d, dt, g
                continue
            yield d, dt, 0


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_row_bytes_match_the_spec_and_the_allocators(fmt):
    cases = list(_cases(fmt))
    assert cases
    for d, dt, group in cases:
        want = spec_row_bytes(fmt, d, dt, group)
        assert fmt.row_bytes(d, dt, group or None) == want, (d, dt, group)
        assert allocated_row_bytes(fmt, d, dt, group) == want, (d, dt, group)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.entry_bytes is None], ids=lambda f:
                         f"{f.family.name}-{f.name}")
def test_head_size_of_inverts_row_bytes(fmt):
    for d in HEAD_SIZES:
        # The indexer's groups: one per row, or mxfp8's 128 (it takes D = 128 and 256 only).
        group = (128 if fmt.name == "mxfp8" else d) if fmt.family is Family.INDEXER else None
        if fmt.name == "mxfp8" and d % 128 or d % fmt.head_size_multiple:
            continue
        assert fmt.head_size_of(fmt.row_bytes(d, torch.float16, group), torch.float16, group) == d
    if fmt.name.startswith("nvfp4"):  # F = 9, 18, ...: nothing else is a row
        assert [fmt.head_size_of(f) for f in (8, 10, 17, 19)] == [None] * 4


def test_nvfp4_reader_refuses_a_row_that_is_no_head_size():
    cache = torch.zeros(NB, BS, H, 10, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^cache: expected a last dim F = D/2 \+ D/16"):
        kvwrite.nvfp4_gather_cache(cache, torch.zeros(1, dtype=torch.long), 1.0)


SPELLINGS = {
    Family.FLASH: ["auto", "bfloat16", "float", "float16", "float32", "fp8", "fp8_e4m3",
                   "fp8_e5m2", "half", "mxfp4", "mxfp8", "nvfp4", "nvfp4_4over6"],
    Family.PER_TOKEN_HEAD: ["fp8_per_token_head", "int4_per_token_head", "int8_per_token_head"],
    Family.MLA: ["auto", "fp8", "fp8_ds_mla", "fp8_e4m3", "fp8_e5m2"],
    Family.INDEXER: ["float32", "mxfp8", "ue8m0"],
    Family.TURBOQUANT: ["turboquant_3bit_nc", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                        "turboquant_k8v4"],
}
# What each writer's own parser returns for a spelling (its enum's value is the format's name).
PARSERS = {
    Family.FLASH: lambda s: dtypes.parse_kv_cache_dtype(s, nvfp4=True, mx=True).value,
    Family.PER_TOKEN_HEAD: lambda s: parse_kv_quant_mode(s).value,
    Family.MLA: lambda s: mla_op.parse_mla_mode(s).value,
    Family.INDEXER: lambda s: parse_scale_fmt(s).value,
    Family.TURBOQUANT: lambda s: formats.turboquant_preset(s).name,
}


@pytest.mark.parametrize("family", list(Family), ids=lambda f: f.name)
def test_lookup_by_every_spelling(family):
    assert formats.spellings(family) == SPELLINGS[family]
    for s in SPELLINGS[family]:
        f = lookup(s, family)
        assert f.family is family and s in f.spellings
        assert PARSERS[family](s) == f.name
        assert lookup(f, family) is f
    enums = {Family.PER_TOKEN_HEAD: parse_kv_quant_mode, Family.MLA: mla_op.parse_mla_mode,
             Family.INDEXER: parse_scale_fmt}
    if family in enums:  # the writers' enums hand out their records
        for s in SPELLINGS[family]:
            assert enums[family](s).format is lookup(s, family)
    aliases = {"half": "float16", "float": "float32", "fp8": "fp8_e4m3"}
    for alias, name in aliases.items():
        if alias in SPELLINGS[family]:
            assert lookup(alias, family) is lookup(name, family)


@pytest.mark.parametrize("family", list(Family), ids=lambda f: f.name)
def test_unknown_spelling_raises_naming_the_argument(family):
    bad = [None, 3, b"fp8"]
    if family is not Family.INDEXER:  # the indexer reads any other string as "float32" (vLLM)
        bad += ["fp16", "FP8", "int4", ""]
    for s in bad:
        with pytest.raises(ValueError, match=rf"^{family.argument}: expected one of "
                                             rf"\[.*\], got {s!r}"):
            lookup(s, family)
    assert lookup("bf16", Family.INDEXER).name == "float32"
    other = next(f for f in FORMATS if f.family is not family)
    with pytest.raises(ValueError, match=rf"^{family.argument}: "):
        lookup(other, family)


def test_flash_parser_errors_are_the_tables_spellings():
    with pytest.raises(ValueError) as e:
        dtypes.parse_kv_cache_dtype("nvfp4")
    plain = [s for s in SPELLINGS[Family.FLASH] if not s.startswith(("nvfp4", "mx"))]
    assert str(e.value) == (f"kv_cache_dtype: expected one of {plain}, got "
                            f"'nvfp4' (the NVFP4 modes are written by reshape_and_cache_flash only)")
    with pytest.raises(ValueError) as e:
        dtypes.parse_kv_cache_dtype("mxfp4", nvfp4=True)
    assert str(e.value) == (f"kv_cache_dtype: expected one of {sorted([*plain, 'nvfp4', 'nvfp4_4over6'])}, "
                            f"got 'mxfp4' (the MX modes are written by reshape_and_cache_flash only)")


def test_storage_dtypes_are_the_writers_cache_dtypes():
    u8 = torch.uint8
    want = {"auto": (torch.bfloat16,), "float16": (torch.float16,), "bfloat16": (torch.bfloat16,),
            "float32": (torch.float32,), "fp8_e4m3": (u8, torch.float8_e4m3fn),
            "fp8_e5m2": (u8, torch.float8_e5m2), "nvfp4": (u8,), "nvfp4_4over6": (u8,),
            "mxfp8": (u8, torch.float8_e4m3fn), "mxfp4": (u8,)}
    for c in dtypes.CacheDType:
        assert dtypes.allowed_cache_dtypes(c, torch.bfloat16) == want[c.value]
        assert lookup(c.value).storage_dtypes(torch.bfloat16) == want[c.value]
    per_token_head = {"int8_per_token_head": (torch.int8,),
                      "fp8_per_token_head": (u8, torch.float8_e4m3fn),
                      "int4_per_token_head": (u8, torch.int8)}
    for name, dts in per_token_head.items():
        assert lookup(name, Family.PER_TOKEN_HEAD).storage == dts
        assert parse_kv_quant_mode(name).cache_dtypes == dts


def test_readers_are_public_ops():
    for f in FORMATS:
        assert callable(getattr(kvwrite, f.reader)), f.reader


def test_scales():
    per_head = torch.ones(4)
    for name in ("fp8_e4m3", "fp8_e5m2"):
        (s,) = lookup(name).scales
        assert (s.placement, s.granularity) == (Placement.ARGUMENT, Granularity.TENSOR_OR_HEAD)
        assert s.kind is dtypes.scale_is_per_head and s.kind(per_head) and not s.kind(per_head[:1])
        (m,) = lookup(name, Family.MLA).scales
        assert (m.placement, m.granularity) == (Placement.ARGUMENT, Granularity.TENSOR)
    block, tensor = lookup("nvfp4").scales
    assert (block.placement, block.group, block.nbytes) == (Placement.IN_PAGE, 16, 1)
    assert tensor.placement is Placement.ARGUMENT
    for name in ("mxfp8", "mxfp4"):
        (mx,) = lookup(name).scales
        assert (mx.placement, mx.granularity, mx.group, mx.nbytes) == (
            Placement.SCALE_CACHE, Granularity.BLOCK, 32, 1)
    (ds,) = lookup("fp8_ds_mla", Family.MLA).scales
    assert (ds.placement, ds.group, ds.nbytes) == (Placement.IN_ROW, 128, 4)
    for f in formats.formats_of(Family.PER_TOKEN_HEAD):
        assert [(s.placement, s.granularity) for s in f.scales] == [
            (Placement.SCALE_CACHE, Granularity.TOKEN_HEAD)]
    assert [m.uses_scale for m in formats.MlaMode] == [False, True, True, False]


def test_old_homes_reexport_the_table():
    assert mla_op.MlaMode is formats.MlaMode
    assert kvwrite.ops.concat_and_cache_mla.MlaMode is formats.MlaMode
    for name in ("DS_MLA_L", "DS_MLA_P", "DS_MLA_PE_DIMS", "DS_MLA_TILE", "DS_MLA_SCALES_OFFSET",
                 "DS_MLA_PE_OFFSET", "DS_MLA_ENTRY"):
        assert getattr(mla_op, name) == getattr(formats, name)
    assert (formats.DS_MLA_SCALES_OFFSET, formats.DS_MLA_PE_OFFSET, formats.DS_MLA_ENTRY) == (
        512, 528, 656)
    assert dtypes.scale_is_per_head is formats.scale_is_per_head
