"""Independent oracles of the five gathers (docs/ops/gather.md), sharing no code with their
references: the row rule as a literal loop over requests and rows in Python integers, the fp8
read rule by a table of code values computed from the bit fields (no float8 cast) and NumPy
float32 arithmetic, bfloat16 rounding by integer arithmetic on the float32 bits. Each oracle
writes into CPU copies of the outputs, one row at a time."""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.gather import clone_tensor, clone_tensors


def oracle_rows(starts, seq_starts, block_table, num_req: int, t_out: int, block_size: int,
                num_blocks: int, workspace: bool = False) -> dict[int, tuple[int, int]]:
    """{row t: (block, offset)} of every row the rule writes, literally: request r owns rows
    [a_r, e_r); each owned row 0 <= t < T_out with p = s_r + (t - a_r) >= 0, p // bs inside the
    table and a block id in [0, num_blocks) is written."""
    a = [int(x) for x in starts.cpu()]
    s = [int(x) for x in seq_starts.cpu()] if seq_starts is not None else None
    table = block_table.cpu()
    rows = {}
    for r in range(num_req):
        e = t_out if workspace and r == num_req - 1 else a[r + 1]
        for t in range(a[r], e):
            if not 0 <= t < t_out:
                continue
            p = (s[r] if s is not None else 0) + (t - a[r])
            if p < 0 or p // block_size >= table.shape[1]:
                continue
            b = int(table[r, p // block_size])
            if 0 <= b < num_blocks:
                rows[t] = (b, p % block_size)
    return rows


@functools.cache
def fp8_values(fmt: str) -> np.ndarray:
    """The 256 codes' values as float64, from the bit fields: e4m3fn (bias 7, 0x7F/0xFF NaN, no
    infinity) or e5m2 (bias 15, 0x7C infinity, 0x7D-0x7F NaN)."""
    out = np.empty(256, dtype=np.float64)
    for c in range(256):
        sign = -1.0 if c & 0x80 else 1.0
        if fmt == "e4m3":
            e, m = (c >> 3) & 15, c & 7
            if e == 15 and m == 7:
                v = float("nan")
            else:
                v = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        else:
            e, m = (c >> 2) & 31, c & 3
            if e == 31:
                v = float("inf") if m == 0 else float("nan")
            else:
                v = m * 2.0**-16 if e == 0 else (1 + m / 4) * 2.0 ** (e - 15)
        out[c] = sign * v
    return out


def dequant_bits(codes: np.ndarray, fmt: str, scale, out_dtype: torch.dtype) -> np.ndarray:
    """The output bits (uint16 or uint32) of D(c, s): the code's value, one float32 product, the
    output dtype by round to nearest even (bfloat16: on the float32 bits)."""
    v = fp8_values(fmt)[codes.astype(np.int64)].astype(np.float32)
    with np.errstate(all="ignore"):
        p = (v * np.asarray(scale, dtype=np.float32)).astype(np.float32)
    if out_dtype == torch.float32:
        return p.view(np.uint32)
    if out_dtype == torch.float16:
        with np.errstate(all="ignore"):
            return p.astype(np.float16).view(np.uint16)
    b = p.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(np.isnan(p), 0x7FC0, r).astype(np.uint16)


def _put(row: torch.Tensor, bits: np.ndarray) -> None:
    """Write element bits into an output row of any strides."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[row.element_size()]
    row.view(ints).copy_(torch.from_numpy(np.ascontiguousarray(bits).view(
        {1: np.uint8, 2: np.int16, 4: np.int32}[row.element_size()])).reshape(row.shape))


def _bytes(x: torch.Tensor) -> np.ndarray:
    return np.frombuffer(x.contiguous().numpy().tobytes(), dtype=np.uint8)


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def oracle_entry(case, inp, dequant: bool):
    """gather_and_maybe_dequant_cache (``dequant``) or cp_gather_cache: the expected dst."""
    want = clone_tensor(inp.dst, "cpu")
    cache = clone_tensor(inp.src_cache, "cpu")
    nb, bs = cache.shape[:2]
    rows = oracle_rows(inp.req.cu_seq_lens, inp.req.seq_starts, inp.req.block_table,
                       inp.req.num_req, inp.req.t_out, bs, nb)
    fmt = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}.get(case.kv_cache_dtype)
    for t, (b, o) in rows.items():
        entry = cache[b, o]
        if dequant and fmt is not None:
            codes = entry.view(torch.uint8).numpy()
            _put(want[t], dequant_bits(codes, fmt, float(inp.scale[0]), want.dtype))
        else:
            ints = _INTS.get(entry.element_size())
            if ints is None:
                want[t] = entry
            else:
                want[t].view(ints).copy_(entry.view(ints))
    return want


def oracle_flash(case, inp):
    """gather_cache_flash: the expected (key_out, value_out)."""
    kc, vc = clone_tensor(inp.key_cache, "cpu"), clone_tensor(inp.value_cache, "cpu")
    outs = clone_tensors(inp.key_out, inp.value_out, device="cpu")
    nb, bs, h, _ = kc.shape
    rows = oracle_rows(inp.req.cu_seq_lens, inp.req.seq_starts, inp.req.block_table,
                       inp.req.num_req, inp.req.t_out, bs, nb)
    fmt = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}.get(case.kv_cache_dtype)
    for cache, want, scale in ((kc, outs[0], inp.k_scale), (vc, outs[1], inp.v_scale)):
        sc = scale.cpu().tolist()
        for t, (b, o) in rows.items():
            for head in range(h):
                src = cache[b, o, head]
                if fmt is not None:
                    s = sc[head] if len(sc) > 1 else sc[0]
                    _put(want[t, head], dequant_bits(src.view(torch.uint8).numpy(), fmt, s,
                                                     want.dtype))
                else:
                    ints = _INTS[src.element_size()]
                    want[t, head].view(ints).copy_(src.view(ints))
    return outs


def oracle_upconvert(inp):
    """cp_gather_and_upconvert_fp8_kv_cache: the expected dst."""
    want = clone_tensor(inp.dst, "cpu")
    cache = clone_tensor(inp.src_cache, "cpu").view(torch.uint8)
    nb, bs = cache.shape[:2]
    rows = oracle_rows(inp.req.workspace_starts, inp.req.seq_starts, inp.req.block_table,
                       inp.req.num_req, inp.req.t_out, bs, nb, workspace=True)
    for t, (b, o) in rows.items():
        e = _bytes(cache[b, o])
        scales = e[512:528].view("<f4")
        bits = np.concatenate([dequant_bits(e[128 * j:128 * (j + 1)], "e4m3", scales[j],
                                            want.dtype) for j in range(4)]
                              + [e[528:656].view("<u2")])
        _put(want[t], bits)
    return want


def oracle_indexer(inp):
    """cp_gather_indexer_k_quant_cache: the expected (dst_k, dst_scale), from the cache's raw
    storage bytes and the page layout."""
    k, sc = clone_tensor(inp.dst_k, "cpu"), clone_tensor(inp.dst_scale, "cpu")
    cache = inp.kv_cache
    raw = storage_bytes(cache).cpu().numpy()
    nb, bs, width = cache.shape
    d = k.shape[1]
    g4 = width - d
    rows = oracle_rows(inp.req.cu_seq_lens, None, inp.req.block_table, inp.req.num_req,
                       inp.req.t_out, bs, nb)
    for t, (b, o) in rows.items():
        page = cache.storage_offset() + b * cache.stride(0)
        _put(k[t], raw[page + o * d:page + o * d + d])
        scale_bytes = raw[page + bs * d + o * g4:page + bs * d + o * g4 + g4]
        _put(sc[t], scale_bytes if sc.dtype == torch.uint8 else scale_bytes.view("<u4"))
    return k, sc
