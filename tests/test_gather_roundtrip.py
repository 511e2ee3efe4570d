"""The consumer proof (docs/ops/gather.md): for every format kvwrite writes, write a sequence set
with the write op, gather it back with the read op, and check (a) the round trip against the
format's rule exactly and (b) that torch's scaled_dot_product_attention over the gathered keys and
values equals attention over the original ones within the format's error (exactly for copies).

- ``auto``, fp8 per tensor and per head (e4m3, e5m2): reshape_and_cache_flash, then
  gather_cache_flash, in the interleaved HND and the packed NHD layouts;
- MLA plain and fp8: concat_and_cache_mla, then gather_and_maybe_dequant_cache;
- ``fp8_ds_mla``: concat_and_cache_mla, then cp_gather_and_upconvert_fp8_kv_cache.

Each sequence's tokens go to the slots its block table names (blocks shuffled, shared by none),
the whole set is gathered with cu_seq_lens (and once more from a context offset with seq_starts),
and attention runs per sequence. On CPU the torch implementations and Triton's interpreter (where
exact) read; on a GPU every implementation does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvwrite
from kvwrite import registry
from kvwrite.dtypes import parse_kv_cache_dtype, quantize
from kvwrite.gather import fp8_dequant
from kvwrite.layouts import KVAlloc, Layout, allocate_kv_cache
from kvwrite.ops.concat_and_cache_mla import reference as mla_ref
from kvwrite.testing.compare import storage_bytes
from params import DEVICES

LENS = (37, 5, 64, 1, 20)  # tokens per sequence
BLOCK = 16
# The largest relative error of one element through the format (half an ulp of the fp8 format's
# 3 or 2 mantissa bits); _bound turns it into one on attention.
REL = {"auto": 0.0, "fp8": 2.0**-4, "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}


def _impls(op: str, device: str) -> list[str]:
    out = []
    for info in registry.all_impls(op):
        if info.available(device) is None:
            out.append(info.name)
    return out


def _sequence_set(device, num_blocks: int, gen: torch.Generator):
    """(block_table [B, max_blocks] int32, slot of every token in sequence order, cu_seq_lens):
    each sequence's blocks drawn without replacement from a shuffled pool."""
    perm = torch.randperm(num_blocks, generator=gen)
    need = [-(-n // BLOCK) for n in LENS]
    table = torch.full((len(LENS), max(need)), -1, dtype=torch.int32)
    slots, at = [], 0
    for r, n in enumerate(LENS):
        blocks = perm[at:at + need[r]]
        at += need[r]
        table[r, :need[r]] = blocks.to(torch.int32)
        slots += [int(blocks[p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    return table.to(device), torch.tensor(slots, device=device), cu.to(device)


def assert_rows_equal(got: torch.Tensor, want: torch.Tensor, name: str,
                      nan_cols: slice | None | bool = False) -> None:
    """Two tensors of one shape and dtype hold the same bits; where ``nan_cols`` is not False,
    elements (of the last-dim columns ``nan_cols``; None: all) that are NaN in both count as equal.
    The message names the first differing element, got vs want."""
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    g, w = got.cpu().contiguous(), want.cpu().contiguous()
    diff = g.view(ints) != w.view(ints)
    if nan_cols is not False:
        both = torch.zeros_like(diff)
        cols = slice(None) if nan_cols is None else nan_cols
        both[..., cols] = torch.isnan(g[..., cols].float()) & torch.isnan(w[..., cols].float())
        diff &= ~both
    if bool(diff.any()):
        idx = torch.nonzero(diff)[0].tolist()
        raise AssertionError(f"{name}: {int(diff.sum())} elements differ; first at {idx}: got "
                             f"{g[tuple(idx)].item()}, want {w[tuple(idx)].item()}")


def _attention_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ref: torch.Tensor,
                     v_ref: torch.Tensor) -> float:
    """The largest |SDPA(q, k, v) - SDPA(q, k_ref, v_ref)| (float32)."""
    out = F.scaled_dot_product_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k_ref, v_ref)
    return float((out - ref).abs().max())


def _bound(rel: float, v_ref: torch.Tensor) -> float:
    """The format's error on attention: twice its element error (``rel``, plus the output dtype's
    rounding) times max|v|. A worst-case bound through the softmax is vacuous (logits may move by
    far more than the element error); over these random sequences fp8 keys and values move
    attention by 0.6 to 1.05 element errors times max|v| (CPU, every format here), while a row off
    by one position, a wrong scale or a dropped row moves it by a large part of max|v|. Exact (0)
    for copies."""
    if rel == 0.0:
        return 0.0
    return 2 * (rel + 2.0**-8) * float(v_ref.abs().max())


# --- gather_cache_flash over reshape_and_cache_flash -----------------------------------------------

FLASH_FORMATS = [("auto", torch.bfloat16, False), ("auto", torch.float16, False),
                 ("fp8", torch.bfloat16, False), ("fp8", torch.float16, True),
                 ("fp8_e5m2", torch.bfloat16, True), ("fp8_e5m2", torch.float32, False)]


# Each format in one of the two layouts, alternating (the layouts' own matrix is test_gather's).
FLASH_RUNS = [(*f, *((Layout.HND, KVAlloc.INTERLEAVED) if i % 2 == 0 else
                     (Layout.NHD, KVAlloc.PACKED))) for i, f in enumerate(FLASH_FORMATS)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv, dtype, per_head, layout, alloc", FLASH_RUNS,
                         ids=[f"{k}-{str(d)[6:]}-{'perhead' if p else 'pertensor'}-{lay.value}-"
                              f"{al.value}" for k, d, p, lay, al in FLASH_RUNS])
def test_flash_round_trip_and_attention(kv, dtype, per_head, layout, alloc, device):
    gen = torch.Generator().manual_seed(7)
    cdt = parse_kv_cache_dtype(kv)
    h, d, num_blocks = 4, 32, 24
    total = sum(LENS)
    key = (torch.randn(total, h, d, generator=gen) * torch.rand(1, h, 1, generator=gen) * 3)
    value = torch.randn(total, h, d, generator=gen)
    key, value = key.to(dtype).to(device), value.to(dtype).to(device)
    table, slots, cu = _sequence_set(device, num_blocks, gen)
    storage = torch.uint8 if cdt.is_fp8 else dtype
    kc, vc = allocate_kv_cache(num_blocks, BLOCK, h, d, storage, layout, alloc, device)
    storage_bytes(kc).zero_()
    storage_bytes(vc).zero_()
    ks = vs = None
    if cdt.is_fp8:
        mx = {"fp8": 448.0, "fp8_e5m2": 57344.0}[kv]
        dims = (0, 2) if per_head else (0, 1, 2)
        ks = (key.float().abs().amax(dim=dims) / mx).reshape(-1).contiguous()
        vs = (value.float().abs().amax(dim=dims) / mx).reshape(-1).contiguous()
    kvwrite.reshape_and_cache_flash(key, value, kc, vc, slots, kv, ks, vs)
    want_k, want_v = key, value
    if cdt.is_fp8:  # D(Q(x)): the write's rule, then the read's
        s_k, s_v = ks.reshape(1, -1, 1), vs.reshape(1, -1, 1)
        want_k = fp8_dequant(quantize(key, cdt, ks, torch.uint8), cdt.fp8_dtype, s_k, dtype)
        want_v = fp8_dequant(quantize(value, cdt, vs, torch.uint8), cdt.fp8_dtype, s_v, dtype)
    q = torch.randn(len(LENS), h, 3, d, generator=gen).to(dtype).to(device)
    for impl in _impls("gather_cache_flash", device):
        if registry.get("gather_cache_flash", impl).unsupported(kc, key, cdt) is not None:
            continue
        ko = torch.full((total + 3, h, d), float("nan"), dtype=dtype, device=device)
        vo = torch.full_like(ko, float("nan"))
        kvwrite.gather_cache_flash(kc, vc, ko, vo, table, cu, kv, ks, vs, implementation=impl)
        # (a) the round trip, row for row (the 3 rows past the set keep their bytes)
        assert_rows_equal(ko[:total], want_k, f"key round trip ({impl})", None)
        assert_rows_equal(vo[:total], want_v, f"value round trip ({impl})", None)
        assert torch.isnan(ko[total:].float()).all()
        # ... and from a context offset: positions 4.. of every sequence
        start = torch.full((len(LENS),), 4, dtype=torch.int64, device=device)
        ko2, vo2 = torch.zeros_like(ko), torch.zeros_like(vo)
        kvwrite.gather_cache_flash(kc, vc, ko2, vo2, table, cu, kv, ks, vs, start,
                                   implementation=impl)
        for r in range(len(LENS)):
            a, e = int(cu[r]), int(cu[r + 1])
            n = max(0, (e - a) - 4)  # positions past the sequence read other slots of its blocks
            assert_rows_equal(ko2[a:a + n], want_k[a + 4:a + 4 + n],
                                 f"key from position 4, sequence {r} ({impl})", None)
        # (b) attention over the gathered keys and values, per sequence
        for r in range(len(LENS)):
            a, e = int(cu[r]), int(cu[r + 1])
            k_g, v_g = ko[a:e].transpose(0, 1).float(), vo[a:e].transpose(0, 1).float()
            k0, v0 = key[a:e].transpose(0, 1).float(), value[a:e].transpose(0, 1).float()
            err = _attention_error(q[r].float(), k_g, v_g, k0, v0)
            bound = _bound(REL[kv], v0)
            assert err <= bound, (f"sequence {r} ({impl}): attention error {err} over "
                                  f"the bound {bound} of {kv}")


# --- MLA: gather_and_maybe_dequant_cache over concat_and_cache_mla ----------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv, dtype", [("auto", torch.bfloat16), ("fp8", torch.bfloat16),
                                       ("fp8_e5m2", torch.float16), ("fp8", torch.float32)])
def test_mla_round_trip_and_attention(kv, dtype, device):
    gen = torch.Generator().manual_seed(11)
    total, num_blocks = sum(LENS), 16
    latent = torch.randn(total, 576, generator=gen).to(dtype).to(device)
    kv_c, k_pe = latent[:, :512], latent[:, 512:]
    table, slots, cu = _sequence_set(device, num_blocks, gen)
    cache = kvwrite.create_mla_cache(num_blocks, BLOCK, 512, 64, kv, dtype, device)
    scale = torch.tensor([float(latent.float().abs().max()) / 448.0], device=device)
    kvwrite.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv, scale)
    mode = kvwrite.MlaMode(kv if kv != "fp8" else "fp8_e4m3")
    want = latent
    if mode.uses_scale:
        codes = mla_ref._fp8(latent, mode.fp8_dtype, scale)
        want = fp8_dequant(codes, mode.fp8_dtype, scale, dtype)
    q = torch.randn(len(LENS), 2, 576, generator=gen).to(device)
    t2s = torch.zeros(total, dtype=torch.int32, device=device)
    for impl in _impls("gather_and_maybe_dequant_cache", device):
        dst = torch.full((total + 2, 576), float("nan"), dtype=dtype, device=device)
        if registry.get("gather_and_maybe_dequant_cache", impl).unsupported(
                cache, dst, mode) is not None:
            continue
        kvwrite.gather_and_maybe_dequant_cache(cache, dst, table, cu, t2s, total, kv, scale,
                                               implementation=impl)
        assert_rows_equal(dst[:total], want, f"latent round trip ({impl})", None)
        assert torch.isnan(dst[total:].float()).all()
        for r in range(len(LENS)):
            a, e = int(cu[r]), int(cu[r + 1])
            k, v = dst[a:e].float(), dst[a:e, :512].float()
            k0, v0 = latent[a:e].float(), latent[a:e, :512].float()
            err = _attention_error(q[r], k, v, k0, v0)
            bound = _bound(REL[kv], v0)
            assert err <= bound, f"sequence {r} ({impl}): attention error {err} > {bound}"


# --- fp8_ds_mla: cp_gather_and_upconvert_fp8_kv_cache over concat_and_cache_mla ---------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ds_mla_round_trip_and_attention(dtype, device):
    gen = torch.Generator().manual_seed(13)
    total, num_blocks = sum(LENS), 16
    latent = torch.randn(total, 576, generator=gen)
    # tiles of very different magnitudes: their scales differ over many binades
    latent[:, :512] *= torch.exp2(torch.randint(-6, 6, (total, 4), generator=gen).float()
                                  ).repeat_interleave(128, dim=1)
    latent = latent.to(dtype).to(device)
    table, slots, cu = _sequence_set(device, num_blocks, gen)
    cache = kvwrite.create_mla_cache(num_blocks, BLOCK, 512, 64, "fp8_ds_mla", dtype, device)
    kvwrite.concat_and_cache_mla(latent[:, :512], latent[:, 512:], cache, slots, "fp8_ds_mla")
    # The format's rule: tile scales and codes as the write makes them, then the read rule.
    entries = mla_ref.ds_mla_rows(latent[:, :512], latent[:, 512:])
    s = entries[:, 512:528].contiguous().view(torch.float32)
    kv_part = fp8_dequant(entries[:, :512].reshape(total, 4, 128), torch.float8_e4m3fn,
                          s[:, :, None], dtype).reshape(total, 512)
    want = torch.cat([kv_part, latent[:, 512:]], dim=1)
    q = torch.randn(len(LENS), 2, 576, generator=gen).to(device)
    ws = cu[:-1]
    for impl in _impls("cp_gather_and_upconvert_fp8_kv_cache", device):
        dst = torch.full((total, 576), float("nan"), dtype=dtype, device=device)
        if registry.get("cp_gather_and_upconvert_fp8_kv_cache", impl).unsupported(
                cache, dst) is not None:
            continue
        kvwrite.cp_gather_and_upconvert_fp8_kv_cache(cache, dst, table, ws, len(LENS),
                                                     implementation=impl)
        assert_rows_equal(dst, want, f"fp8_ds_mla round trip ({impl})", slice(0, 512))
        for r in range(len(LENS)):
            a, e = int(cu[r]), int(cu[r + 1])
            k, v = dst[a:e].float(), dst[a:e, :512].float()
            k0, v0 = latent[a:e].float(), latent[a:e, :512].float()
            err = _attention_error(q[r], k, v, k0, v0)
            bound = _bound(REL["fp8"], v0)
            assert err <= bound, f"sequence {r} ({impl}): attention error {err} > {bound}"
