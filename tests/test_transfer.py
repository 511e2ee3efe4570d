"""Moving caches (SPEC §9): each op's torch reference against an independent oracle (per-pair
Python loops over explicit byte offsets of the whole allocations), the page's byte layout
written out by hand, kv_page_bytes, the plan builders' coalescing, and every error of §9.5
with nothing changed. Kernels: tests/test_transfer_cuda.py, tests/test_transfer_triton.py; every
implementation against the reference: tests/test_conformance.py."""

from __future__ import annotations

import dataclasses
import itertools
import re
import struct

import pytest
import torch

import kvwrite
from kvwrite import transfer
from kvwrite.ops.nvfp4.rule import e2m1_codes, e4m3_code
from kvwrite.testing import conformance
from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.transfer import mapping, random_values, random_view

# --- the oracles: explicit byte offsets ----------------------------------------------------------


def _elem_offset(t: torch.Tensor, block: int, idx) -> int:
    """Byte offset in t's storage of element ``t[block][idx]``."""
    return (t.storage_offset() + block * t.stride(0)
            + sum(a * s for a, s in zip(idx, t.stride()[1:], strict=True))) * t.element_size()


def oracle_swap(src, dst, pairs, src_heads=None, dst_heads=None):
    """dst's storage bytes after copying each pair's elements (heads: relayout's (h0, K) of each
    side over dim 1)."""
    sb, out = storage_bytes(src).clone(), storage_bytes(dst).clone()
    es = src.element_size()
    shape = list(src.shape[1:])
    if src_heads is not None:
        shape[0] = src_heads[1]
    for i, j in pairs:
        for idx in itertools.product(*map(range, shape)):
            si = (idx[0] + src_heads[0], *idx[1:]) if src_heads else idx
            di = (idx[0] + dst_heads[0], *idx[1:]) if dst_heads else idx
            so, do = _elem_offset(src, i, si), _elem_offset(dst, j, di)
            out[do:do + es] = sb[so:so + es]
    return out


def _assert_bytes(t: torch.Tensor, want: torch.Tensor, name: str) -> None:
    got = storage_bytes(t).cpu()
    diff = torch.nonzero(got != want).flatten()
    assert diff.numel() == 0, f"{name}: {diff.numel()} bytes differ, first at {diff[:8].tolist()}"


# --- swap_blocks ---------------------------------------------------------------------------------

# (block shape, src strides, dst strides): dense, padded blocks, permuted dims, 1-element blocks,
# more than three dims that do not coalesce.
SWAP_LAYOUTS = {
    "dense": ((4, 2, 8), None, None),
    "padded": ((4, 2, 8), (80, 16, 8, 1), (64, 16, 8, 1)),
    "permuted": ((4, 2, 8), (64, 1, 16, 2), (64, 16, 8, 1)),
    "scalar-blocks": ((), (3,), (1,)),
    "five-dims": ((2, 3, 2, 2, 3), (200, 90, 25, 12, 5, 1), (72 * 2, 72, 24, 12, 6, 2)),
}


def _swap_pair(layout, dtype, nsrc=7, ndst=6, seed=0):
    shape, ss, ds = SWAP_LAYOUTS[layout]
    src = random_view((nsrc, *shape), ss, dtype, offset=3, seed=seed)
    dst = random_view((ndst, *shape), ds, dtype, offset=1, seed=seed + 1)
    return src, dst


@pytest.mark.parametrize("layout", list(SWAP_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("map_dtype", [torch.int64, torch.int32])
def test_swap_blocks_matches_the_oracle(layout, dtype, map_dtype):
    src, dst = _swap_pair(layout, dtype)
    pairs = [[6, 0], [2, 5], [2, 3]]  # a repeated source
    want = oracle_swap(src, dst, pairs)
    kvwrite.swap_blocks(src, dst, mapping(pairs, map_dtype, odd_strides=True))
    _assert_bytes(dst, want, "dst")


def test_swap_blocks_multi_layer_each_pair_its_own_geometry():
    """A hybrid model's groups: each pair its dtype, block shape and counts, one mapping."""
    a = _swap_pair("padded", torch.bfloat16, 5, 6)
    b = _swap_pair("five-dims", torch.float32, 8, 7, seed=4)
    pairs = [[4, 0], [1, 5]]
    want = [oracle_swap(s, d, pairs) for s, d in (a, b)]
    kvwrite.swap_blocks_multi_layer((a[0], b[0]), [a[1], b[1]], mapping(pairs, torch.int32))
    _assert_bytes(a[1], want[0], "dst_caches[0]")
    _assert_bytes(b[1], want[1], "dst_caches[1]")


def test_swap_blocks_in_place_form():
    """src and dst the same view: a copy inside one cache (vLLM's copy_blocks)."""
    cache = random_view((6, 4, 2, 8), (80, 16, 8, 1), torch.bfloat16)
    pairs = [[0, 3], [1, 4], [0, 5]]
    want = oracle_swap(cache, cache, pairs)
    kvwrite.swap_blocks(cache, cache, mapping(pairs))
    _assert_bytes(cache, want, "cache")


def test_swap_blocks_four_argument_form_copies_bytes_at_the_block_stride():
    """vLLM's form: block i is the bytes from i * stride(0) * element_size(), whatever the other
    dims (padding travels, inner strides ignored)."""
    src = random_view((5, 3, 8), (40, 8, 1), torch.float16, seed=1)   # 80-byte blocks
    dst = random_view((4, 3, 8), (24, 1, 3), torch.float16, seed=2)   # 48-byte blocks
    pairs, size = [[4, 0], [1, 3]], 44
    sb, want = storage_bytes(src).clone(), storage_bytes(dst).clone()
    for i, j in pairs:
        so = src.storage_offset() * 2 + i * 80
        do = dst.storage_offset() * 2 + j * 48
        want[do:do + size] = sb[so:so + size]
    kvwrite.swap_blocks(src, dst, size, mapping(pairs))
    _assert_bytes(dst, want, "dst")
    plan = transfer.build_swap_bytes(src, dst, size, mapping(pairs))
    (job,) = plan.jobs
    assert (job.heads, job.tokens, job.elems, job.elem_bytes) == (1, 1, size, 1)
    assert job.src.strides == (80, 0, 0, 1) and job.dst.strides == (48, 0, 0, 1)


def test_empty_mapping_writes_nothing_but_validates():
    src, dst = _swap_pair("dense", torch.bfloat16)
    before = storage_bytes(dst).clone()
    kvwrite.swap_blocks(src, dst, torch.zeros(0, 2, dtype=torch.int32))
    _assert_bytes(dst, before, "dst")
    with pytest.raises(ValueError, match="max_ctas: expected None or an int >= 1, got 0"):
        kvwrite.swap_blocks(src, dst, torch.zeros(0, 2, dtype=torch.int32), max_ctas=0)


def test_host_to_host_runs_the_torch_implementation_only():
    src, dst = _swap_pair("dense", torch.bfloat16)
    with pytest.raises(ValueError, match="cannot run this call: both sides are in host memory"):
        kvwrite.swap_blocks(src, dst, mapping([[0, 0]]), implementation="cuda")
    kvwrite.swap_blocks(src, dst, mapping([[0, 0]]), implementation="torch", engine="ce",
                        max_ctas=2)  # both keywords validated, no other use on the host


# --- coalescing ----------------------------------------------------------------------------------

def test_dense_blocks_coalesce_into_one_row():
    src, dst = _swap_pair("dense", torch.bfloat16)
    (job,) = transfer.build_swap(src, dst, mapping([[0, 0]])).jobs
    assert (job.heads, job.tokens, job.elems, job.elem_bytes) == (1, 1, 64, 2)
    assert job.dense_rows and job.row_bytes == 128


def test_padded_blocks_keep_their_rows():
    src = random_view((3, 4, 2, 8), (80, 16, 8, 1))
    dst = random_view((3, 4, 2, 8), (64, 16, 8, 1))
    (job,) = transfer.build_swap(src, dst, mapping([[0, 0]])).jobs
    assert (job.heads, job.tokens, job.elems) == (1, 1, 64)  # dense past the block dim
    dst = random_view((3, 4, 2, 8), (128, 32, 8, 1))          # a pad between heads
    (job,) = transfer.build_swap(src, dst, mapping([[0, 0]])).jobs
    assert (job.heads, job.tokens, job.elems) == (1, 4, 16)
    assert job.src.strides == (160, 0, 32, 2) and job.dst.strides == (256, 0, 64, 2)


def test_more_than_three_dims_split_into_jobs():
    src, dst = _swap_pair("five-dims", torch.float32)
    plan = transfer.build_swap(src, dst, mapping([[0, 0]]))
    assert len(plan.jobs) > 1
    assert all(j.src.tensor is src and j.dst.tensor is dst for j in plan.jobs)


# --- relayout_kv_cache: layouts and head ranges --------------------------------------------------

def _cache(layout: str, blocks: int, heads: int, n: int = 4, c: int = 6, seed: int = 0,
           dtype=torch.bfloat16):
    """A logical (blocks, H, N, C) view: "BHNC" (dense), "BNHC" (vLLM's default), "padded"."""
    if layout == "BHNC":
        return random_view((blocks, heads, n, c), None, dtype, seed=seed)
    if layout == "BNHC":
        return random_view((blocks, heads, n, c), (n * heads * c, c, heads * c, 1), dtype,
                           offset=2, seed=seed)
    st = heads * n * (c + 2) + 3
    return random_view((blocks, heads, n, c), (st, n * (c + 2), c + 2, 1), dtype, seed=seed)


@pytest.mark.parametrize("src_layout, dst_layout", [("BNHC", "BHNC"), ("BHNC", "padded"),
                                                    ("padded", "BNHC")])
@pytest.mark.parametrize("head_range, src_h, dst_h", [
    (None, 4, 4), ((1, 3), 4, 2), ((1, 3), 2, 5), ((2, 4), 5, 4)])
def test_relayout_matches_the_oracle(src_layout, dst_layout, head_range, src_h, dst_h):
    """head_range: a rank takes its slice of a full cache, gives it back, and two full sides
    copy the same heads."""
    src = _cache(src_layout, 5, src_h, seed=1)
    dst = _cache(dst_layout, 4, dst_h, seed=2)
    pairs = [[4, 1], [0, 3]]
    if head_range is None:
        want = oracle_swap(src, dst, pairs)
    else:
        k = head_range[1] - head_range[0]
        hs = 0 if src_h == k else head_range[0]
        hd = 0 if dst_h == k else head_range[0]
        want = oracle_swap(src, dst, pairs, (hs, k), (hd, k))
    kvwrite.relayout_kv_cache(src, dst, mapping(pairs, torch.int32, odd_strides=True),
                              head_range)
    _assert_bytes(dst, want, "dst")


def test_relayout_lists_one_call_for_all_layers():
    srcs = [_cache("BNHC", 5, 4, seed=s) for s in range(3)]
    dsts = [_cache("padded", 4 + s, 4, seed=10 + s) for s in range(3)]
    pairs = [[1, 0], [3, 2]]
    want = [oracle_swap(s, d, pairs) for s, d in zip(srcs, dsts, strict=True)]
    kvwrite.relayout_kv_cache(srcs, dsts, mapping(pairs))
    for i, (d, w) in enumerate(zip(dsts, want, strict=True)):
        _assert_bytes(d, w, f"dst[{i}]")


# --- the page ------------------------------------------------------------------------------------

def test_kv_page_bytes_is_the_table():
    bf16 = torch.bfloat16
    # raw: H * L*N*C*es
    assert kvwrite.kv_page_bytes(32, 8, 16, 256, bf16, kv_split=2) == 8 * 32 * 16 * 256 * 2
    # fp8: 16 * ceil((4*L*S + L*N*C) / 16) per head: 4*3*2 + 3*4*6 = 96
    assert kvwrite.kv_page_bytes(3, 2, 4, 6, bf16, kv_split=2, page_format="fp8") == 2 * 96
    # 4*1*1 + 1*1*3 = 7 -> 16
    assert kvwrite.kv_page_bytes(1, 1, 1, 3, torch.float32, page_format="fp8_e5m2") == 16
    # nvfp4: 4*2*2 + 2*4*64/2 + 2*4*64/16 = 16 + 256 + 32 = 304
    assert kvwrite.kv_page_bytes(2, 3, 4, 64, bf16, kv_split=2, page_format="nvfp4") == 3 * 304
    # 4 + 16/2 + 1 = 13 -> 16
    assert kvwrite.kv_page_bytes(1, 1, 1, 16, torch.float16, page_format="nvfp4") == 16


@pytest.mark.parametrize("args, kwargs, exc, text", [
    ((0, 1, 1, 1, torch.bfloat16), {}, ValueError, "num_layers: expected an int >= 1, got 0"),
    ((1, True, 1, 1, torch.bfloat16), {}, TypeError, "num_heads: expected an int >= 1, got bool"),
    ((1, 1, 1.0, 1, torch.bfloat16), {}, TypeError, "block_size: expected an int >= 1, got float"),
    ((1, 1, 1, 6, "bf16"), {}, TypeError, "dtype: expected a torch.dtype, got str"),
    ((1, 1, 1, 6, torch.bfloat16), {"kv_split": 4}, ValueError,
     "kv_split: expected an int dividing row_width = 6, got 4"),
    ((1, 1, 1, 6, torch.bfloat16), {"page_format": "int4"}, ValueError,
     "page_format: expected one of"),
    ((1, 1, 1, 32, torch.bfloat16), {"page_format": "nvfp4", "kv_split": 4}, ValueError,
     "page_format: 'nvfp4' expects E = C / kv_split a multiple of 16, got E = 8"),
    ((1, 1, 1, 32, torch.uint8), {"page_format": "fp8"}, ValueError,
     "dtype: page_format='fp8_e4m3' expects caches of dtype"),
])
def test_kv_page_bytes_refuses(args, kwargs, exc, text):
    with pytest.raises(exc, match=re.escape(text)):
        kvwrite.kv_page_bytes(*args, **kwargs)


def _caches(L=2, blocks=5, H=3, N=2, C=8, dtype=torch.bfloat16, values=False, seed=0):
    make = random_values if values else random_view
    out = []
    for l_ in range(L):
        if l_ % 2:  # vLLM's default order (block, token, head, C) for odd layers
            out.append(make((blocks, H, N, C), (N * H * C + 4, C, H * C, 1), dtype,
                            seed=seed + l_))
        else:
            out.append(make((blocks, H, N, C), None, dtype, offset=1, seed=seed + l_))
    return out


def test_raw_page_layout_by_hand():
    """Element (l, s, t, e) of head k goes to byte ((l*S + s)*N + t)*E + e, times es, of head
    chunk hp(k); P = H * L*N*C*es."""
    L, H, N, C, S = 2, 3, 2, 8, 2
    E, es = C // S, 2
    caches = _caches(L, H=H, N=N, C=C)
    hb = L * N * C * es
    pages = random_view((3, H * hb), (H * hb + 9, 1), torch.uint8, seed=7)
    want = storage_bytes(pages).clone()
    pairs = [[4, 2], [0, 0]]
    for b, p in pairs:
        for k, l_, s, t, e in itertools.product(range(H), range(L), range(S), range(N), range(E)):
            src = storage_bytes(caches[l_])
            so = _elem_offset(caches[l_], b, (k, t, s * E + e))
            q = ((l_ * S + s) * N + t) * E + e
            do = p * pages.stride(0) + k * hb + q * es
            want[do:do + es] = src[so:so + es]
    kvwrite.pack_kv_pages(caches, pages, mapping(pairs), kv_split=S)
    _assert_bytes(pages, want, "pages")
    # ... and unpack writes those elements back, nothing else of the caches.
    back = [random_view(c.shape, c.stride(), c.dtype, offset=c.storage_offset(), seed=20 + i)
            for i, c in enumerate(caches)]
    want_back = []
    for c, d in zip(caches, back, strict=True):
        w = storage_bytes(d).clone()
        cb = storage_bytes(c)
        for p_row, b in ((2, 1), (0, 3)):
            src_block = {2: 4, 0: 0}[p_row]
            for idx in itertools.product(range(H), range(N), range(C)):
                so, do = _elem_offset(c, src_block, idx), _elem_offset(d, b, idx)
                w[do:do + es] = cb[so:so + es]
        want_back.append(w)
    kvwrite.unpack_kv_pages(pages, back, mapping([[2, 1], [0, 3]]), kv_split=S)
    for i, (d, w) in enumerate(zip(back, want_back, strict=True)):
        _assert_bytes(d, w, f"caches[{i}]")


def _f32_bytes(x: float) -> list[int]:
    return list(struct.pack("<f", x))


@pytest.mark.parametrize("fmt, fp8", [("fp8", torch.float8_e4m3fn),
                                      ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_page_layout_by_hand(fmt, fp8):
    """Per head chunk: float32 sigma(l, s) at 4*(l*S + s), code of element q at 4*L*S + q, zeros
    to the end; the other chunk of the row (head_range) untouched."""
    L, H, N, C, S = 2, 3, 3, 6, 2
    E = C // S
    caches = _caches(L, H=H, N=N, C=C, values=True)
    hb = 16 * -(-(4 * L * S + L * N * C) // 16)
    assert kvwrite.kv_page_bytes(L, 2, N, C, torch.bfloat16, kv_split=S, page_format=fmt) == 2 * hb
    pages = random_view((2, 2 * hb), None, torch.uint8, seed=3)
    scale = torch.tensor([[0.5], [0.25]], dtype=torch.float32).expand(L, S).reshape(L, S, 1) \
        * torch.tensor([1.0, 2.0, 4.0]).reshape(1, 1, H)
    want = storage_bytes(pages).clone()
    b, p, h0 = 4, 1, 1  # heads [1, 3) of the caches into a page of two chunks
    for k in range(2):
        chunk = [0] * hb
        for l_, s in itertools.product(range(L), range(S)):
            sig = float(scale[l_, s, h0 + k])
            chunk[4 * (l_ * S + s):4 * (l_ * S + s) + 4] = _f32_bytes(sig)
            for t, e in itertools.product(range(N), range(E)):
                x = torch.tensor(float(caches[l_][b, h0 + k, t, s * E + e]), dtype=torch.float32)
                y = x / torch.tensor(sig, dtype=torch.float32)
                mx = torch.finfo(fp8).max
                code = int(y.clamp(-mx, mx).to(fp8).view(torch.uint8))
                chunk[4 * L * S + ((l_ * S + s) * N + t) * E + e] = code
        want[p * 2 * hb + k * hb:p * 2 * hb + (k + 1) * hb] = torch.tensor(chunk, dtype=torch.uint8)
    kvwrite.pack_kv_pages(caches, pages, mapping([[b, p]]), kv_split=S, head_range=(1, 3),
                          page_format=fmt, scale=scale)
    _assert_bytes(pages, want, "pages")
    # Unpack: D(code, sigma) rounded to the cache dtype, into heads [1, 3) of block 0.
    out = _caches(L, H=H, N=N, C=C, dtype=torch.float32, seed=30)
    want_out = [storage_bytes(o).clone() for o in out]
    for k, l_, s, t, e in itertools.product(range(2), range(L), range(S), range(N), range(E)):
        sig = float(scale[l_, s, h0 + k])
        code = want[p * 2 * hb + k * hb + 4 * L * S + ((l_ * S + s) * N + t) * E + e]
        v = code.view(fp8).float() * torch.tensor(sig, dtype=torch.float32)
        off = _elem_offset(out[l_], 0, (h0 + k, t, s * E + e))
        want_out[l_][off:off + 4] = v.reshape(1).view(torch.uint8)
    kvwrite.unpack_kv_pages(pages, out, mapping([[p, 0]]), kv_split=S, head_range=(1, 3),
                            page_format=fmt)
    for i, (o, w) in enumerate(zip(out, want_out, strict=True)):
        _assert_bytes(o, w, f"caches[{i}]")


def test_nvfp4_page_layout_by_hand():
    """Sigmas, then element q in byte 4*L*S + q//2 (low nibble when e is even), then the scale
    byte of group g of row r at 4*L*S + L*N*C/2 + r*E/16 + g, zeros to the end. Each group by
    SPEC §6.1 written out: S = E4M3(amax / (6 sigma)), codes E2M1(x / (float(S) sigma))."""
    L, H, N, C, S = 1, 1, 2, 32, 2
    E = C // S
    caches = _caches(L, H=H, N=N, C=C, dtype=torch.float32, values=True)
    hb = kvwrite.kv_page_bytes(L, H, N, C, torch.float32, kv_split=S, page_format="nvfp4")
    assert hb == 16 * -(-(4 * 2 + 32 + 4) // 16) == 48
    pages = random_view((1, hb), None, torch.uint8, seed=5)
    sig = torch.tensor([[[0.75], [1.5]]], dtype=torch.float32)  # [L, S, 1]
    chunk = [0] * hb
    for s in range(S):
        chunk[4 * s:4 * s + 4] = _f32_bytes(float(sig[0, s, 0]))
    for s, t in itertools.product(range(S), range(N)):
        r = s * N + t
        x = caches[0][2, 0, t, s * E:(s + 1) * E].float()
        k = sig[0, s, 0]
        a = x.abs().max()
        code_s = e4m3_code(a / (torch.tensor(6.0) * k))
        d = code_s.view(torch.float8_e4m3fn).float() * k
        codes = e2m1_codes(x * (1 / d))
        for e in range(E):
            q = r * E + e
            byte = 4 * L * S + q // 2
            chunk[byte] |= int(codes[e]) << (0 if e % 2 == 0 else 4)
        chunk[4 * L * S + L * N * C // 2 + r * E // 16] = int(code_s)
    kvwrite.pack_kv_pages(caches, pages, mapping([[2, 0]]), kv_split=S, page_format="nvfp4",
                          scale=sig)
    want = storage_bytes(pages).clone()
    want[:hb] = torch.tensor(chunk, dtype=torch.uint8)
    _assert_bytes(pages, want, "pages")


@pytest.mark.parametrize("fmt", ["raw", "fp8", "nvfp4"])
def test_pack_then_unpack_round_trip(fmt):
    """raw: the caches' bits come back; quantized: each chunk holds its sigmas, so an unpack into
    another rank's head slice decodes the same values as a full one."""
    L, H, N, C = 2, 4, 2, 32
    caches = _caches(L, H=H, N=N, C=C, values=True)
    P = kvwrite.kv_page_bytes(L, H, N, C, torch.bfloat16, kv_split=2, page_format=fmt)
    pages = random_view((3, P), None, torch.uint8, seed=9)
    scale = None if fmt == "raw" else torch.tensor([0.5, 1.0, 2.0, 4.0])
    kvwrite.pack_kv_pages(caches, pages, mapping([[1, 2], [3, 0]]), kv_split=2, page_format=fmt,
                          scale=scale)
    full = _caches(L, H=H, N=N, C=C, seed=40)
    kvwrite.unpack_kv_pages(pages, full, mapping([[2, 0]]), kv_split=2, page_format=fmt)
    part = _caches(L, H=2, N=N, C=C, seed=50)
    kvwrite.unpack_kv_pages(pages, part, mapping([[2, 4]]), kv_split=2, page_format=fmt,
                            head_range=(2, 4))
    for l_ in range(L):
        assert torch.equal(part[l_][4].view(torch.int16), full[l_][0, 2:4].view(torch.int16))
        if fmt == "raw":
            assert torch.equal(full[l_][0].view(torch.int16), caches[l_][1].view(torch.int16))


# --- CPU mapping rules and the errors of §9.5 -----------------------------------------------------

def _swap_args():
    src, dst = _swap_pair("padded", torch.bfloat16)
    return {"src": src, "dst": dst, "block_mapping": mapping([[1, 0], [2, 3]])}


def _pack_args(fmt="fp8"):
    caches = tuple(_caches(2, H=2, N=2, C=32, values=True))
    P = kvwrite.kv_page_bytes(2, 2, 2, 32, torch.bfloat16, kv_split=2, page_format=fmt)
    return {"caches": caches, "pages": random_view((3, P), None, torch.uint8),
            "block_mapping": mapping([[1, 0], [2, 2]]), "kv_split": 2, "page_format": fmt,
            "scale": torch.tensor([0.5, 2.0])}


def _swap(**change):
    return lambda: (lambda a: ((), {**a, **{k: f(a) for k, f in change.items()}}))(_swap_args())


def _pack(**change):
    return lambda: (lambda a: ((), {**a, **{k: f(a) for k, f in change.items()}}))(_pack_args())


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


SWAP = kvwrite.swap_blocks
PACK = kvwrite.pack_kv_pages
ERRORS = [
    # the mapping: type, shape, dtype, ids, duplicates, in-place conflict
    ("mapping list", SWAP, _swap(block_mapping=lambda a: [[1, 0]]), TypeError,
     "block_mapping: expected a torch.Tensor, got list"),
    ("mapping shape", SWAP, _swap(block_mapping=lambda a: a["block_mapping"].reshape(-1)),
     ValueError, "block_mapping: expected shape [n, 2], got (4,)"),
    ("mapping dtype", SWAP, _swap(block_mapping=lambda a: a["block_mapping"].to(torch.int16)),
     ValueError, "block_mapping: expected dtype int64 or int32, got torch.int16"),
    ("source id", SWAP, _swap(block_mapping=lambda a: mapping([[7, 0]])), ValueError,
     "block_mapping: expected ids in [0, 7) in column 0 (the block count of src), got 7 at row 0"),
    ("negative id", SWAP, _swap(block_mapping=lambda a: mapping([[0, 0], [1, -1]])), ValueError,
     "block_mapping: expected ids in [0, 6) in column 1 (the block count of dst), got -1 at row 1"),
    ("duplicate destination", SWAP, _swap(block_mapping=lambda a: mapping([[0, 2], [1, 2]])),
     ValueError, "block_mapping: expected distinct destination ids (column 1), got id 2 2 times"),
    ("in-place conflict", SWAP, _swap(dst=lambda a: a["src"],
                                      block_mapping=lambda a: mapping([[0, 1], [1, 2]])),
     ValueError, "block_mapping: expected no id both a source and a destination"),
    # shapes and dtypes
    ("block shape", SWAP, _swap(dst=lambda a: a["dst"][:, :2]), ValueError,
     "dst: expected the block shape of src (4, 2, 8), got (2, 2, 8)"),
    ("dtype", SWAP, _swap(dst=lambda a: a["dst"].view(torch.float16)), ValueError,
     "dst: expected the dtype of src (torch.bfloat16), got torch.float16"),
    ("bytes too many", SWAP, lambda: ((_swap_args()["src"], _swap_args()["dst"], 130,
                                       mapping([[0, 0]])), {}), ValueError,
     "block_size_in_bytes: expected 0 < block_size_in_bytes <= dst.stride(0) * element_size() = 128, got 130"),
    ("bytes zero", SWAP, lambda: ((_swap_args()["src"], _swap_args()["dst"], 0,
                                   mapping([[0, 0]])), {}), ValueError,
     "block_size_in_bytes: expected 0 < block_size_in_bytes"),
    ("bytes past storage", SWAP, lambda: ((random_view((4, 8), pad=0), random_view((4, 8), pad=0)[:, :4].as_strided((4, 4), (8, 1), 4), 16, mapping([[0, 0]])), {}),
     ValueError, "block_size_in_bytes: expected every byte of dst's 4 blocks in its storage"),
    # destinations
    ("zero stride", SWAP, _swap(dst=lambda a: a["dst"][:, :1].expand(6, 4, 2, 8)), ValueError,
     "dst: expected every element in its own memory, got stride 0 over a dim of size 4"),
    ("requires grad", SWAP, _swap(src=lambda a: a["src"].float(), dst=lambda a: torch.zeros(6, 4, 2, 8, requires_grad=True)),
     ValueError, "dst: expected a tensor that does not require grad"),
    ("overlap", SWAP, _swap(src=lambda a: a["dst"].as_strided(a["dst"].shape, a["dst"].stride(), 2)),
     ValueError, "expected memory apart from dst's"),
    ("two destinations the same view", kvwrite.swap_blocks_multi_layer,
     lambda: ((), {"src_caches": (_swap_args()["src"], _swap_args()["src"].clone()),
                   "dst_caches": [(d := _swap_args()["dst"]), d],
                   "block_mapping": mapping([[0, 0]])}),
     ValueError, "dst_caches[1]: expected a destination apart from dst_caches[0], got the same view"),
    ("list lengths", kvwrite.swap_blocks_multi_layer,
     lambda: ((), {"src_caches": [_swap_args()["src"]], "dst_caches": [],
                   "block_mapping": mapping([[0, 0]])}),
     ValueError, "dst_caches: expected at least one tensor, got none"),
    # devices
    ("meta", SWAP, _swap(dst=lambda a: _meta(a["dst"])), ValueError,
     "dst: expected a tensor with memory (a CUDA device or the host), got a meta tensor"),
    # keywords
    ("max_ctas bool", SWAP, _swap(max_ctas=lambda a: True), TypeError,
     "max_ctas: expected None or an int >= 1, got bool"),
    ("max_ctas zero", SWAP, _swap(max_ctas=lambda a: 0), ValueError,
     "max_ctas: expected None or an int >= 1, got 0"),
    ("engine", SWAP, _swap(engine=lambda a: "dma"), ValueError,
     "engine: expected one of ['auto', 'sm', 'ce'], got 'dma'"),
    ("head_range order", kvwrite.relayout_kv_cache,
     lambda: ((_cache("BHNC", 3, 4), _cache("BHNC", 3, 2), mapping([[0, 0]]), (3, 1)), {}),
     ValueError, "head_range: expected 0 <= h0 < h1, got (3, 1)"),
    ("head_range floats", kvwrite.relayout_kv_cache,
     lambda: ((_cache("BHNC", 3, 4), _cache("BHNC", 3, 2), mapping([[0, 0]]), (0.0, 2)), {}),
     TypeError, "head_range: expected None or two Python ints (h0, h1), got (0.0, 2)"),
    ("head_range past H", kvwrite.relayout_kv_cache,
     lambda: ((_cache("BHNC", 3, 4), _cache("BHNC", 3, 2), mapping([[0, 0]]), (3, 5)), {}),
     ValueError, "head_range: (3, 5) expects src with 2 heads (the slice) or at least 5 (full), got 4"),
    ("heads differ", kvwrite.relayout_kv_cache,
     lambda: ((_cache("BHNC", 3, 4), _cache("BHNC", 3, 2), mapping([[0, 0]])), {}),
     ValueError, "dst: expected 4 heads (those of src; or pass head_range), got 2"),
    ("relayout N", kvwrite.relayout_kv_cache,
     lambda: ((_cache("BHNC", 3, 4), _cache("BHNC", 3, 4, n=3), mapping([[0, 0]])), {}),
     ValueError, "dst: expected the N and C of src (4, 6), got (3, 6)"),
    # pages
    ("kv_split", PACK, _pack(kv_split=lambda a: 3), ValueError,
     "kv_split: expected an int dividing C = 32, got 3"),
    ("page_format", PACK, _pack(page_format=lambda a: "fp4"), ValueError,
     "page_format: expected one of"),
    ("nvfp4 E", PACK, _pack(page_format=lambda a: "nvfp4", kv_split=lambda a: 4), ValueError,
     "page_format: 'nvfp4' expects E = C / kv_split a multiple of 16, got E = 8"),
    ("pages dtype", PACK, _pack(pages=lambda a: a["pages"].view(torch.int8)), ValueError,
     "pages: expected dtype uint8, got torch.int8"),
    ("pages P", PACK, _pack(pages=lambda a: a["pages"][:, :-16]), ValueError,
     "pages: expected P a positive multiple of the head chunk"),
    ("pages stride", PACK, _pack(pages=lambda a: a["pages"][:, ::2]), ValueError,
     "pages: expected a unit last stride"),
    ("quantized cache dtype", PACK, _pack(caches=lambda a: tuple(c.view(torch.int16) for c in a["caches"])),
     ValueError, "caches[0]: page_format='fp8_e4m3' expects caches of dtype"),
    ("caches H_c", PACK, _pack(caches=lambda a: (a["caches"][0], a["caches"][1][:, :1])),
     ValueError, "caches[1]: expected the H_c, N, C of caches[0] (2, 2, 32), got (1, 2, 32)"),
    ("scale missing", PACK, _pack(scale=lambda a: None), ValueError,
     "scale: page_format='fp8_e4m3' needs a float32 tensor"),
    ("scale dtype", PACK, _pack(scale=lambda a: a["scale"].double()), ValueError,
     "scale: expected dtype float32, got torch.float64"),
    ("scale shape", PACK, _pack(scale=lambda a: torch.ones(3)), ValueError,
     "scale: expected a shape broadcastable to [L, S, H_c] = [2, 2, 2], got (3,)"),
    ("ce quantized", PACK, _pack(engine=lambda a: "ce"), ValueError,
     "engine: 'ce' copies raw bytes only"),
    ("page rows", PACK, _pack(block_mapping=lambda a: mapping([[0, 3]])), ValueError,
     "block_mapping: expected ids in [0, 3) in column 1 (the block count of pages), got 3"),
    ("pages overlap scale", PACK, _pack(scale=lambda a: a["pages"][0, :8].view(torch.float32)),
     ValueError, "scale: expected memory apart from pages's"),
]


@pytest.mark.parametrize("fn, make, exc, text", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_errors_change_nothing(fn, make, exc, text):
    args, kwargs = make()
    before = conformance.snapshot(args, {k: tuple(v) if isinstance(v, list) else v
                                         for k, v in kwargs.items()})
    with pytest.raises(exc, match=re.escape(text)):
        fn(*args, **kwargs)
    assert conformance.unchanged(before)


def test_an_error_in_the_last_layer_writes_no_layer():
    """Every pair of swap_blocks_multi_layer is validated before anything is written."""
    a, b = _swap_pair("dense", torch.bfloat16), _swap_pair("dense", torch.bfloat16, seed=3)
    before = [storage_bytes(a[1]).clone()]
    with pytest.raises(ValueError, match=re.escape("dst_caches[1]: expected the dtype of src_caches[1]")):
        kvwrite.swap_blocks_multi_layer([a[0], b[0]], [a[1], b[1].view(torch.float16)],
                                        mapping([[0, 0]]))
    _assert_bytes(a[1], before[0], "dst_caches[0]")


# --- the GPU ---------------------------------------------------------------------------------------

def _place(t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """``t``'s whole allocation on the GPU (or pinned), the same view of it."""
    raw = storage_bytes(t)
    raw = raw.pin_memory() if pinned else raw.cuda()
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


@pytest.mark.gpu
def test_gpu_mapping_skips_out_of_range_pairs():
    """A GPU mapping is not checked: a pair with an id out of range (-1 pads) is skipped."""
    src, dst = _swap_pair("padded", torch.bfloat16)
    want = oracle_swap(src, dst, [[1, 0], [3, 4]])
    src, dst = _place(src), _place(dst)
    pairs = [[1, 0], [-1, 2], [2, 6], [3, 4]]
    kvwrite.swap_blocks(src, dst, mapping(pairs, torch.int32, device="cuda"),
                        implementation="torch")
    _assert_bytes(dst, want, "dst")


@pytest.mark.gpu
@pytest.mark.parametrize("make, text", [
    (lambda: (torch.zeros(4, 8).cuda(), torch.zeros(4, 8)), "dst: expected pinned host memory"),
    (lambda: (torch.zeros(4, 8).cuda(), torch.zeros(4, 8, device="meta")), "dst: expected a tensor with memory"),
])
def test_gpu_device_rules(make, text):
    src, dst = make()
    with pytest.raises(ValueError, match=re.escape(text)):
        kvwrite.swap_blocks(src, dst, mapping([[0, 0]]))


@pytest.mark.gpu
def test_cpu_mapping_under_capture_is_refused():
    src = torch.zeros(4, 8, device="cuda")
    dst = torch.zeros(4, 8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="block_mapping: expected a mapping on the GPU under CUDA graph capture"), torch.cuda.graph(g):
        kvwrite.swap_blocks(src, dst, mapping([[0, 0]]))


@pytest.mark.gpu
@pytest.mark.parametrize("make, exc, text", [
    (lambda: ((torch.zeros(4, 8, device="cuda"), torch.zeros(4, 8, device="cuda"),
               mapping([[0, 0]], device="cuda")), {"engine": "ce"}),
     ValueError, "engine: 'ce' reads the mapping on the host"),
    (lambda: ((torch.zeros(4, 8), torch.zeros(4, 8), mapping([[0, 0]], device="cuda")), {}),
     ValueError, "block_mapping: expected host memory (that of the sides), got cuda:0"),
    (lambda: ((torch.zeros(4, 8, device="cuda"), torch.zeros(4, 8).pin_memory(),
               mapping([[0, 0]])), {"max_ctas": 2.0}),
     TypeError, "max_ctas: expected None or an int >= 1, got float"),
    (lambda: (([torch.zeros(2, 1, 2, 32, device="cuda")], torch.zeros(2, 80, dtype=torch.uint8,
                                                                       device="cuda"),
               mapping([[0, 0]])), {"page_format": "fp8", "scale": torch.ones(1)}),
     ValueError, "scale: expected device cuda:0 (that of the caches), got cpu"),
])
def test_gpu_argument_rules(make, exc, text):
    args, kwargs = make()
    fn = kvwrite.pack_kv_pages if isinstance(args[0], list) else kvwrite.swap_blocks
    before = conformance.snapshot(tuple(a for a in args if not isinstance(a, list)), kwargs)
    with pytest.raises(exc, match=re.escape(text)):
        fn(*args, **kwargs)
    assert conformance.unchanged(before)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_pinned_host_side_matches_the_oracle(direction):
    src, dst = _swap_pair("padded", torch.bfloat16)
    pairs = [[6, 0], [2, 5]]
    want = oracle_swap(src, dst, pairs)

    src, dst = _place(src, direction == "h2d"), _place(dst, direction == "d2h")
    kvwrite.swap_blocks(src, dst, mapping(pairs), implementation="torch")
    torch.cuda.synchronize()
    _assert_bytes(dst, want, "dst")


# --- two GPUs: the call's device and the peer rules (kvwrite.transfer.call_devices) -------------
#
# call_devices reads each tensor's device and is_pinned() only: stand-ins with a CUDA device test
# its rules on a machine without GPUs (tests/test_transfer_peer.py runs the ops on two).

@dataclasses.dataclass
class _On:
    """A stand-in tensor on ``device`` (pinned where it is host memory and ``pinned``)."""

    device: torch.device
    pinned: bool = False

    def is_pinned(self) -> bool:
        return self.pinned


def _on(spec: str) -> _On:
    return _On(torch.device("cpu"), True) if spec == "pinned" else _On(torch.device(spec))


@pytest.fixture
def peers(monkeypatch):
    """Peer access between every two GPUs; records the (device, peer) pairs asked."""
    asked = []

    def can(device, peer):
        asked.append((device, peer))
        return True
    monkeypatch.setattr(transfer, "_can_access_peer", can)
    return asked


@pytest.mark.parametrize("src, dst", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0"),
                                      ("cuda:3", "cuda:2")])
def test_a_call_across_two_gpus_runs_on_the_destination(peers, src, dst):
    sources = [("src[0]", _on(src)), ("src[1]", _on(src))]
    destinations = [("dst[0]", _on(dst)), ("dst[1]", _on(dst))]
    assert transfer.call_devices(sources, destinations) == (torch.device(dst), torch.device(src))
    assert peers == [(torch.device(dst).index, torch.device(src).index)]  # dst reads src


@pytest.mark.parametrize("sides, device", [
    ((["cuda:1"], ["cuda:1"]), "cuda:1"),
    ((["cuda:1"], ["pinned"]), "cuda:1"),
    ((["pinned"], ["cuda:0"]), "cuda:0"),
    ((["cpu"], ["cpu"]), None),
])
def test_one_gpu_calls_have_no_peer(peers, sides, device):
    named = [[(f"{n}[{i}]", _on(x)) for i, x in enumerate(side)]
             for n, side in zip(("src", "dst"), sides, strict=True)]
    want = None if device is None else torch.device(device)
    assert transfer.call_devices(*named) == (want, None)
    assert transfer.call_devices(*named, one_gpu="one GPU per call") == (want, None)
    assert peers == []


@pytest.mark.parametrize("sources, destinations, one_gpu, text", [
    (["cuda:0"], ["cuda:1"], "one GPU per call of pack_kv_pages: pages move between GPUs "
     "through a transport such as torch.distributed",
     "dst[0]: expected the device of src[0] (cuda:0) or pinned host memory (one GPU per call "
     "of pack_kv_pages: pages move between GPUs through a transport such as torch.distributed)"
     ", got cuda:1"),
    (["cuda:0", "pinned"], ["cuda:1"], None,
     "src[1]: expected a GPU (a call across two GPUs, cuda:0 and cuda:1, takes no host memory), "
     "got pinned host memory"),
    (["cuda:0"], ["cuda:1", "cpu"], None,
     "dst[1]: expected a GPU (a call across two GPUs, cuda:0 and cuda:1, takes no host memory), "
     "got pageable host memory"),
    (["cuda:0", "cuda:1"], ["cuda:1"], None,
     "src[1]: expected the device of src[0] (cuda:0): a call across two GPUs has its sources on "
     "one and its destinations on the other, got cuda:1"),
    (["cuda:0"], ["cuda:1", "cuda:0"], None,
     "dst[1]: expected the device of dst[0] (cuda:1): a call across two GPUs has its sources on "
     "one and its destinations on the other, got cuda:0"),
    (["cuda:0"], ["cuda:1", "cuda:2"], None,
     "dst[1]: expected the device of the sources or of the destinations (cuda:0 (src[0]) and "
     "cuda:1 (dst[0]): at most two GPUs a call), got cuda:2"),
    (["cuda:0"], ["meta"], None, "dst[0]: expected a tensor with memory"),
])
def test_two_gpu_calls_refused(peers, sources, destinations, one_gpu, text):
    named = [[(f"{n}[{i}]", _on(x)) for i, x in enumerate(side)]
             for n, side in (("src", sources), ("dst", destinations))]
    with pytest.raises(ValueError, match="^" + re.escape(text)):
        transfer.call_devices(*named, one_gpu=one_gpu)


def test_two_gpus_without_peer_access_name_the_source(monkeypatch):
    asked = []
    monkeypatch.setattr(transfer, "_can_access_peer", lambda d, p: asked.append((d, p)))
    with pytest.raises(ValueError, match="^" + re.escape(
            "src_caches[0]: expected a GPU that cuda:0 (the device of dst_caches[0]) can access "
            "as a peer, got cuda:1: peer access between cuda:1 and cuda:0 is unavailable")):
        transfer.call_devices([("src_caches[0]", _on("cuda:1"))],
                              [("dst_caches[0]", _on("cuda:0"))])
    assert asked == [(0, 1)]


def test_call_device_keeps_one_gpu_per_call(peers):
    with pytest.raises(ValueError, match="^" + re.escape(
            "dst: expected the device of src (cuda:0) or pinned host memory (one GPU per call), "
            "got cuda:1")):
        transfer.call_device([("src", _on("cuda:0")), ("dst", _on("cuda:1"))])
    assert peers == []


@pytest.mark.parametrize("where, peer, text", [
    ("cuda:0", "cuda:0", "block_mapping: expected host memory or cuda:1 (the destination's "
     "device: a call across two GPUs runs there), got cuda:0"),
    ("cuda:0", None, "block_mapping: expected host memory or cuda:1 (that of the sides), got "
     "cuda:0"),
])
def test_a_mapping_lies_on_the_call_device(where, peer, text):
    m = _on(where)
    with pytest.raises(ValueError, match="^" + re.escape(text)):
        transfer.check_mapping_device(m, torch.device("cuda:1"),
                                      None if peer is None else torch.device(peer))
    transfer.check_mapping_device(_on("cuda:1"), torch.device("cuda:1"), torch.device("cuda:0"))
    transfer.check_mapping_device(_on("pinned"), torch.device("cuda:1"), torch.device("cuda:0"))


# --- the plan cache: a hit is a miss --------------------------------------------------------------

def _plan_fields(plan: transfer.TransferPlan) -> dict:
    """Every field of a plan, tensors by identity (a hit's plan and a miss's hold the same ones)."""
    out = {f: getattr(plan, f) for f in ("op", "page_job", "pairs", "device", "max_ctas", "engine",
                                         "jobs")}
    out["args"] = {k: tuple(map(id, v)) if isinstance(v, tuple) else
                   id(v) if isinstance(v, torch.Tensor) else v for k, v in plan.args.items()}
    out["mapping"] = plan.mapping
    return out


def _miss_then_hit(build, *args, **kwargs):
    """(a miss's plan, a hit's plan) of one call."""
    transfer.clear_plan_cache()
    miss = build(*args, **kwargs)
    hit = build(*args, **kwargs)
    assert hit.jobs.launch_key is miss.jobs.launch_key, "the second call missed"
    return miss, hit


def _layers(L=3, seed=0):
    src = [random_view((5, 4, 2, 8), (96, 8, 48, 1), seed=seed + i) for i in range(L)]
    dst = [random_view((6, 4, 2, 8), seed=seed + 10 + i) for i in range(L)]
    return src, dst


PLAN_CALLS = {
    "swap": lambda: (transfer.build_swap, _swap_pair("padded", torch.bfloat16), {}),
    "multi layer": lambda: (transfer.build_swap, _layers(),
                            {"op": "swap_blocks_multi_layer", "listed": True,
                             "names": ("src_caches", "dst_caches")}),
    "four arguments": lambda: (lambda s, d, m: transfer.build_swap_bytes(s, d, 64, m),
                               _swap_pair("padded", torch.bfloat16), {}),
    "relayout": lambda: (transfer.build_relayout, ([_cache("BHNC", 3, 4)], [_cache("BNHC", 4, 2)]),
                         {"head_range": (1, 3)}),
    "pack raw": lambda: (transfer.build_pack, (_pack_args("raw")["caches"],
                                               _pack_args("raw")["pages"]), {"kv_split": 2}),
    "pack fp8": lambda: (transfer.build_pack, (_pack_args()["caches"], _pack_args()["pages"]),
                         {"kv_split": 2, "page_format": "fp8", "scale": torch.tensor([0.5, 2.0])}),
    "unpack nvfp4": lambda: (transfer.build_unpack, (_pack_args("nvfp4")["pages"],
                                                     _pack_args("nvfp4")["caches"]),
                             {"kv_split": 2, "page_format": "nvfp4"}),
}


@pytest.mark.parametrize("call", list(PLAN_CALLS))
def test_plan_cache_hit_is_the_plan_of_a_miss(call):
    """A second call with the same tensors reuses the first's record and gets the plan a miss
    makes: every field equal, the same tensors, the mapping of this call."""
    build, (a, b), kw = PLAN_CALLS[call]()
    m1 = mapping([[0, 1], [2, 0]])
    miss, hit = _miss_then_hit(build, a, b, m1, **kw)
    assert _plan_fields(hit) == _plan_fields(miss)
    assert hit.jobs == miss.jobs and all(type(j) is transfer.CopyJob for j in hit.jobs)
    for x, y in zip(hit.jobs, miss.jobs, strict=True):
        assert x.src.tensor is y.src.tensor and x.dst.tensor is y.dst.tensor
    m2 = mapping([[1, 2]])
    again = build(a, b, m2, **kw)
    assert again.mapping is m2 and again.host_mapping is m2 and again.pairs == 1
    assert again.jobs == miss.jobs and again.page_job == miss.page_job


def test_plan_cache_hit_writes_the_bytes_of_a_miss():
    """swap_blocks_multi_layer and pack_kv_pages called again with the same tensors and new
    mappings write what fresh tensors (a miss) get."""
    def run(cached: bool):
        src, dst = _layers(seed=5)
        pack = _pack_args("fp8")
        for pairs in ([[0, 1], [2, 0]], [[4, 5], [1, 1]], [[3, 2]]):
            if not cached:
                transfer.clear_plan_cache()
            kvwrite.swap_blocks_multi_layer(src, dst, mapping(pairs))
            kvwrite.pack_kv_pages(pack["caches"], pack["pages"],
                                  mapping([[i % 5, j % 3] for i, j in pairs[:2]]),
                                  kv_split=2, page_format="fp8", scale=pack["scale"])
        return [storage_bytes(t).clone() for t in (*dst, pack["pages"])]

    for got, want in zip(run(True), run(False), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("change", ["as_strided_", "set_", "resize_", "requires_grad_"])
def test_plan_cache_misses_a_tensor_changed_in_place(change):
    """A tensor whose view changes in place (same Python object) gets the plan of its new view,
    and its new errors."""
    src, dst = _swap_pair("padded", torch.bfloat16)
    m = mapping([[0, 1]])
    transfer.clear_plan_cache()
    first = transfer.build_swap(src, dst, m)
    if change == "as_strided_":
        dst.as_strided_((5, *dst.shape[1:]), dst.stride(), dst.storage_offset())
    elif change == "set_":
        other = torch.zeros(6 * 128, dtype=torch.bfloat16)
        dst.set_(other.untyped_storage(), 4, dst.shape, dst.stride())
    elif change == "resize_":
        dst.resize_(4, 4, 2, 8)
    if change == "requires_grad_":
        dst.requires_grad_()
        with pytest.raises(ValueError, match=re.escape("dst: expected a tensor that does not "
                                                       "require grad")):
            transfer.build_swap(src, dst, m)
        return
    got = transfer.build_swap(src, dst, m)
    assert got.jobs.launch_key is not first.jobs.launch_key
    transfer.clear_plan_cache()
    assert _plan_fields(got) == _plan_fields(transfer.build_swap(src, dst, m))
    # A change that makes the call wrong raises on the next call.
    dst.as_strided_((6, 4, 2, 8), (0, 16, 8, 1))
    with pytest.raises(ValueError, match=re.escape("dst: expected every element in its own memory")):
        transfer.build_swap(src, dst, m)


def test_plan_cache_keeps_no_tensor_alive():
    """A cached call's tensors are freed when the caller drops them (the record holds weak
    references only), and a new tensor at a freed one's id and address misses."""
    import gc
    import weakref

    transfer.clear_plan_cache()
    src, dst = _layers()
    plan = transfer.build_swap(src, dst, mapping([[0, 1]]), listed=True)
    refs = [weakref.ref(t) for t in (*src, *dst)]
    assert transfer.build_swap(src, dst, mapping([[0, 1]]), listed=True).jobs.launch_key is \
        plan.jobs.launch_key
    del src, dst, plan
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(transfer._PLANS) == 1  # the record stays (bounded), holding nothing


def test_plan_cache_is_bounded():
    transfer.clear_plan_cache()
    keep = [_swap_pair("dense", torch.bfloat16, seed=i) for i in range(transfer.PLAN_CACHE_SIZE + 3)]
    for src, dst in keep:
        transfer.build_swap(src, dst, mapping([[0, 0]]))
    assert len(transfer._PLANS) == transfer.PLAN_CACHE_SIZE
    # Least recently used first out: the first calls are gone, the last ones hit.
    last = transfer.build_swap(*keep[-1], mapping([[0, 0]]))
    assert last.jobs.launch_key is transfer.build_swap(*keep[-1], mapping([[0, 0]])).jobs.launch_key


# Per-call arguments checked on a hit as on a miss: (name, the call's changes, exception, text).
HIT_ERRORS = [
    ("mapping list", {"block_mapping": lambda a: [[1, 0]]}, TypeError,
     "block_mapping: expected a torch.Tensor, got list"),
    ("mapping shape", {"block_mapping": lambda a: mapping([[1, 0]]).reshape(-1)}, ValueError,
     "block_mapping: expected shape [n, 2]"),
    ("mapping dtype", {"block_mapping": lambda a: mapping([[1, 0]], torch.int16)}, ValueError,
     "block_mapping: expected dtype int64 or int32"),
    ("source id", {"block_mapping": lambda a: mapping([[7, 0]])}, ValueError,
     "block_mapping: expected ids in [0, 7) in column 0 (the block count of src), got 7 at row 0"),
    ("duplicate destination", {"block_mapping": lambda a: mapping([[0, 2], [1, 2]])}, ValueError,
     "block_mapping: expected distinct destination ids"),
    ("mapping in a destination", {"block_mapping": lambda a: a["dst"].view(torch.int64)[:2, :2]
                                  .as_strided((1, 2), (1, 1))},
     ValueError, "block_mapping: expected memory apart from dst's"),
    ("max_ctas", {"max_ctas": lambda a: 0}, ValueError, "max_ctas: expected None or an int >= 1"),
    ("engine", {"engine": lambda a: "dma"}, ValueError, "engine: expected one of"),
]


@pytest.mark.parametrize("name, change, exc, text", HIT_ERRORS, ids=[e[0] for e in HIT_ERRORS])
def test_plan_cache_hit_raises_the_errors_of_a_miss(name, change, exc, text):
    """With the record of a valid call cached, a call with the same tensors and a bad mapping,
    max_ctas or engine raises the miss's error, message for message, and writes nothing."""
    a = _swap_args()
    a["dst"] = random_view((6, 4, 2, 8), (128, 16, 8, 1), torch.int64)  # a mapping can live there
    a["src"] = random_view((7, 4, 2, 8), (96, 16, 8, 1), torch.int64, seed=2)
    bad = {**a, **{k: f(a) for k, f in change.items()}}
    errors = []
    for cached in (False, True):
        transfer.clear_plan_cache()
        if cached:
            kvwrite.swap_blocks(**a)
            assert len(transfer._PLANS) == 1
        before = conformance.snapshot((), bad)
        with pytest.raises(exc, match=re.escape(text)) as e:
            kvwrite.swap_blocks(**bad)
        assert conformance.unchanged(before)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_plan_cache_pack_errors_on_a_hit():
    """Pack's per-call checks on a hit: page rows of a CPU mapping, 'ce' with a quantized
    format."""
    a = _pack_args()
    transfer.clear_plan_cache()
    kvwrite.pack_kv_pages(**a)
    with pytest.raises(ValueError, match=re.escape("block_mapping: expected ids in [0, 3) in "
                                                   "column 1 (the block count of pages), got 3")):
        kvwrite.pack_kv_pages(**{**a, "block_mapping": mapping([[0, 3]])})
    with pytest.raises(ValueError, match=re.escape("engine: 'ce' copies raw bytes only")):
        kvwrite.pack_kv_pages(**{**a, "engine": "ce"})


def test_plan_cache_memoizes_the_cuda_launches():
    """copy_launches / page_launches of a cached plan's jobs are those of the same jobs in a plain
    tuple (no GPU needed)."""
    from kvwrite.kernels import transfer_cuda

    src, dst = _layers()
    transfer.clear_plan_cache()
    plan = transfer.build_swap(src, dst, mapping([[0, 1]]), listed=True)
    want = transfer_cuda.copy_launches(tuple(plan.jobs))
    assert transfer_cuda.copy_launches(plan.jobs) == want
    assert transfer_cuda._MEMO[(plan.jobs.launch_key, transfer_cuda.TUNING)] == tuple(want)
    assert transfer_cuda.copy_launches(transfer.build_swap(
        src, dst, mapping([[1, 1]]), listed=True).jobs) == want
    a = _pack_args()
    pj = transfer.build_pack(a["caches"], a["pages"], a["block_mapping"], kv_split=2,
                             page_format="fp8", scale=a["scale"]).page_job
    want = transfer_cuda.page_launches(dataclasses.replace(pj, caches=tuple(pj.caches)))
    assert transfer_cuda.page_launches(pj) == want == transfer_cuda.page_launches(pj)
    assert transfer_cuda._MEMO[(pj.caches.launch_key, "pages")] == tuple(want)


@pytest.mark.skipif(not torch.cuda.is_available()
                    and kvwrite.kernels.triton_transfer.available(torch.device("cpu")) is not None,
                    reason="Triton's interpreter (TRITON_INTERPRET=1) or a GPU")
def test_plan_cache_triton_memo_writes_the_bytes_of_a_miss():
    """triton_transfer.run of cached plans (their copy and page launches memoized) with new
    mappings writes what the same jobs in a plain tuple (nothing memoized) write."""
    from kvwrite.kernels import triton_transfer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def run(memo: bool):
        src, dst = _layers(seed=7)
        src, dst = [t.to(device) for t in src], [t.to(device) for t in dst]
        a = {k: v.to(device) if isinstance(v, torch.Tensor) else v
             for k, v in _pack_args().items()}
        caches = tuple(c.to(device) for c in a["caches"])
        transfer.clear_plan_cache()
        for pairs in ([[0, 1], [2, 0]], [[2, 1]], [[1, 2], [0, 0], [2, 1]]):
            m = mapping(pairs, device=device)
            plan = transfer.build_swap(src, dst, m, listed=True)
            pack = transfer.build_pack(caches, a["pages"], m, kv_split=2, page_format="fp8",
                                       scale=a["scale"])
            if not memo:
                plan = dataclasses.replace(plan, jobs=tuple(plan.jobs))
                pack = dataclasses.replace(pack, page_job=dataclasses.replace(
                    pack.page_job, caches=tuple(pack.page_job.caches)))
            triton_transfer.run(dataclasses.replace(plan, device=device))
            triton_transfer.run(dataclasses.replace(pack, device=device))
            if memo:
                for keyed, what in ((plan.jobs, "copy"), (pack.page_job.caches, "pages")):
                    key = (keyed.launch_key, what, triton_transfer.TUNING, len(pairs), None,
                           device)
                    assert key in triton_transfer._LAUNCHES
        return [storage_bytes(t).cpu() for t in (*dst, a["pages"])]

    for got, want in zip(run(True), run(False), strict=True):
        assert torch.equal(got, want)


def test_a_sides_jobs_share_its_least_block_count():
    """A GPU mapping's pair out of range of any tensor of a side is skipped whole (SPEC §9.1, as
    the reference skips it): the kernels read each job's block counts, so every job of a side
    carries the least of them (layers of a hybrid model with different block counts)."""
    src = [torch.zeros(n, 2, 4) for n in (5, 3, 7)]
    dst = [torch.zeros(n, 2, 4) for n in (6, 4, 2)]
    plan = transfer.build_swap(src, dst, torch.tensor([[0, 1]]), op="swap_blocks_multi_layer",
                               names=("src_caches", "dst_caches"), listed=True)
    assert {(j.src.blocks, j.dst.blocks) for j in plan.jobs} == {(3, 2)}
    again = transfer.build_swap(src, dst, torch.tensor([[1, 0]]), op="swap_blocks_multi_layer",
                                names=("src_caches", "dst_caches"), listed=True)
    assert {(j.src.blocks, j.dst.blocks) for j in again.jobs} == {(3, 2)}
