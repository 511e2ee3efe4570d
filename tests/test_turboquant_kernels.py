"""The Triton and CUDA kernels of reshape_and_cache_turboquant against an oracle of SPEC §10.2
written here: per (token, head), one float32 torch operation per step (each an IEEE
round-to-nearest-even result), the sums by the padded pairwise tree level by level, rhu in
float64 (exact), the fields packed through one Python integer per field.

CPU: Triton under its interpreter on small shapes (every preset, input dtype and slot dtype;
special rows), NVRTC compiles of every CUDA variant. GPU (``gpu`` marker): both implementations
on larger shapes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import pathlib
import re

import pytest
import torch

from host import TRITON_PTX_PRELUDE, build_emu_lib, run_emu_program, run_triton_script
from kvwrite.testing.compare import storage_bytes
from sass import needs_nvrtc

PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
MSE_PRESETS = PRESETS[1:]
_BITS = {"turboquant_k8v4": (8, 4), "turboquant_4bit_nc": (4, 4),
         "turboquant_k3v4_nc": (3, 4), "turboquant_3bit_nc": (3, 3)}
EPS = 1e-8  # float32(1e-8) = bits 0x322BCC77 once rounded
# Every launch path on the GPU (_gpu_impl): both CUDA lane widths, Triton's k8v4 rows kernel.
GPU_PATHS = ["cuda", "cuda-wide", "cuda-nosplit", "cuda-generic", "triton", "triton-rows", "triton-row1", "triton-program-a-row"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """The fields of the op's preset record that the implementations read (SPEC §10.1)."""

    name: str
    key_bits: int
    value_bits: int
    mse: bool
    norm_correction: bool
    key_packed_size: int
    value_data_bytes: int
    slot_size: int
    slot_size_aligned: int


def make_preset(name: str, d: int) -> Preset:
    kb, vb = _BITS[name]
    mse = kb != 8
    kps = -(-d * kb // 8) + 2 if mse else d
    vdb = -(-d * vb // 8)
    size = kps + vdb + 4
    return Preset(name, kb, vb, mse, mse, kps, vdb, size, size + size % 2)


def test_preset_sizes_match_the_spec_table():
    assert [make_preset(p, 128).slot_size for p in PRESETS] == [196, 134, 118, 102]


# ------------------------------------------------------------------------------------------
# The oracle
# ------------------------------------------------------------------------------------------
def _f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def _tree(x: torch.Tensor) -> torch.Tensor:
    """§7.1's tree over dim 0 of float32 ``x``: padded with +0 to a power of two, neighbours
    added level by level (each addition one float32 RN)."""
    n = x.shape[0]
    p = 1 << max(0, n - 1).bit_length()
    x = torch.cat([x, torch.zeros((p - n,) + tuple(x.shape[1:]), dtype=torch.float32)])
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]


def _fp16_bytes(v: torch.Tensor) -> list[int]:
    b = int(v.reshape(1).to(torch.float16).view(torch.int16).item()) & 0xFFFF
    b = 0x7E00 if math.isnan(v.item()) else b
    return [b & 255, b >> 8]


def _pack(codes: list[int], bits: int) -> list[int]:
    w = 0
    for i, c in enumerate(codes):
        assert 0 <= c < (1 << bits)
        w |= c << (bits * i)
    nbytes = -(-len(codes) * bits // 8)
    return list(w.to_bytes(nbytes, "little"))


def oracle_slot(k: torch.Tensor, v: torch.Tensor, preset: Preset, pit, mids
                ) -> tuple[list[int], list[tuple[int, int]]]:
    """(the slot_size bytes, the NaN fields as (offset, width)) of one (token, head); k, v: the
    input rows (any float dtype). The NaN encodings the contract leaves free are the kernels'
    fixed ones: e4m3 0x7F, float16 0x7E00."""
    x = k.float()
    out: list[int] = []
    nan_fields: list[tuple[int, int]] = []
    if not preset.mse:
        c = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
        nan_fields += [(i, 1) for i in range(x.numel()) if math.isnan(x[i].item())]
        out += [0x7F if math.isnan(xi) else ci for xi, ci in zip(x.tolist(), c, strict=True)]
    else:
        ss = _tree(x * x)
        n = _f32(math.sqrt(ss.item()))  # the float64 root rounded once: RN(sqrt(ss))
        den = n + _f32(EPS)
        u = x / den
        y = _tree(u[:, None] * pit)  # [D]: y_j = tree over i of RN(u_i * PiT[i, j])
        idx = (y[:, None] >= mids[None, :]).sum(1).tolist()
        out += _pack(idx, preset.key_bits)
        if math.isnan(n.item()):
            nan_fields.append((len(out), 2))
        out += _fp16_bytes(n)
    vv = v.float()
    ok = ~torch.isnan(vv)
    if ok.any():
        mn, mx = vv[ok].min(), vv[ok].max()
    else:
        mn, mx = _f32(0.0), _f32(0.0)
    if mn.item() == 0.0:
        mn = _f32(0.0)
    L = (1 << preset.value_bits) - 1
    s = (mx - mn) / _f32(L)
    if not (s.item() > _f32(EPS).item()):
        s = _f32(EPS)
    q = ((vv - mn) / s).double()
    codes = []
    for qi in q.tolist():
        c = 0 if math.isnan(qi) else math.floor(qi + 0.5) if not math.isinf(qi) else (
            L if qi > 0 else 0)
        codes.append(min(max(c, 0), L))
    out += _pack(codes, preset.value_bits)
    out += _fp16_bytes(s) + _fp16_bytes(mn)
    assert len(out) == preset.slot_size
    return out, nan_fields


def oracle_write(key, value, kv_cache, slot_mapping, preset, pit, mids) -> torch.Tensor:
    """The expected bytes of kv_cache's whole allocation (uint8, flat) after the call."""
    nb, bs, h, _ = kv_cache.shape
    base = storage_bytes(kv_cache).clone()
    st = kv_cache.stride()
    off0 = kv_cache.storage_offset()
    pitf = pit.float() if pit is not None else None
    midf = mids.float() if mids is not None else None
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0 or slot >= nb * bs:
            continue
        b, p = divmod(slot, bs)
        for hh in range(h):
            data, _ = oracle_slot(key[t, hh], value[t, hh], preset, pitf, midf)
            o = off0 + b * st[0] + p * st[1] + hh * st[2]
            base[o:o + len(data)] = torch.tensor(data, dtype=torch.uint8)
    return base


def assert_written(kv_cache, expected, what):
    """Every byte of the allocation (the slots' pad bytes and the unwritten slots included)."""
    got = storage_bytes(kv_cache).cpu()
    diff = got != expected
    if diff.any():
        i = int(diff.nonzero()[0])
        raise AssertionError(f"{what}: {int(diff.sum())} bytes differ, first at byte {i}: got "
                             f"{int(got[i])}, expected {int(expected[i])}")


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------
def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(d)


def make_case(preset_name, dtype, slot_dtype, d, *, t=7, h=2, nb=4, bs=4, extra=3, seed=0,
              device="cpu", special=True, pit_kind="random", vllm_alloc=True):
    g = torch.Generator().manual_seed(seed)
    preset = make_preset(preset_name, d)
    t_pad = t + 2
    key = (torch.randn(t_pad, h, d + 2, generator=g) * 3).to(dtype)[:, :, :d]
    value = (torch.randn(t_pad, h, d + 2, generator=g) * 3 + 1).to(dtype)[:, :, :d]
    if special:
        rows = [0.0, float("nan"), float("inf"), -float("inf"), 7.0, 1e-30, -0.0, 65504.0 * 4]
        key[0, 0] = 0.0
        key[1, 0, 1] = float("nan")
        key[1, 1, 0] = float("inf")
        key[2, 0] = -0.0
        key[2, 1, : d // 2] = 3e19 if dtype != torch.float16 else 60000.0
        value[0, 0] = 7.0  # a constant row
        value[0, 1] = float("nan")  # no non-NaN value
        value[1, 0, 2] = float("inf")
        value[1, 1, 3] = -float("inf")
        value[2, 0] = torch.tensor(rows[: d] * (d // len(rows[:d]) + 1))[:d].to(dtype)
        value[2, 1] = float("inf")  # all +inf: s = FL
        value[3, 1, 0] = float("nan")
        value[3, 0] = -0.0
        # Ties of the rounding (4-bit: s = 1, quotients x.5 round up).
        ties = torch.tensor([0.0, 15.0, 0.5, 1.5, 2.5, 7.5, 14.5, 3.0] * (d // 8 + 1))[:d]
        value[4, 0] = ties.to(dtype)
        if t_pad > 5:
            # A row on the fast value path (s = the floor 1e-8) whose small elements are
            # subnormal or far below s (their quotients must give code 0, not garbage), the
            # others near the codes' boundaries 1/2 and 3/2.
            tiny = [0.0, 1e-40, 2.0**-70, 3e-39, 5e-9, 7.5e-9, 1.5e-8, 1e-9]
            value[5, 0] = torch.tensor(tiny * (d // 8 + 1))[:d].to(dtype)
    if pit_kind == "hadamard":
        pit = hadamard(d)
    elif pit_kind == "identity":
        pit = torch.eye(d)
    else:
        pit = torch.randn(d, d, generator=g) / math.sqrt(d)
    pit = pit.t().contiguous().t() if seed % 2 else pit  # strides free
    nm = (1 << preset.key_bits) - 1 if preset.mse else 0
    mids = (torch.sort(torch.randn(nm, generator=g)).values / math.sqrt(d)) if nm else None
    if mids is not None and pit_kind == "identity":
        # Midpoints equal to some y_j = u_j of token 0, head 1 (a written row): the ties take
        # the upper centroid.
        x = key[0, 1].float()
        den = _f32(math.sqrt(_tree(x * x).item())) + _f32(EPS)
        ties = (x / den)[:nm]
        # D < 2^b - 1 (D = 8, 4 bits): the ties, completed by the random midpoints to 2^b - 1
        mids = torch.sort(torch.cat([ties, mids[:nm - ties.numel()]])).values
    assert mids is None or mids.numel() == nm, "midpoints: 2^b - 1 of them, as the op validates"
    s = preset.slot_size_aligned + (0 if vllm_alloc else 3)
    if vllm_alloc:
        kv_cache = torch.randint(0, 256, (nb, h, bs, s), generator=g, dtype=torch.uint8)
        kv_cache = kv_cache.transpose(1, 2)
    else:
        kv_cache = torch.randint(0, 256, (nb, bs, h, s), generator=g, dtype=torch.uint8)
    n = nb * bs
    # The last two tokens skipped (padding, out of range): the special rows (tokens 0-4) are
    # all written.
    slots = torch.randperm(n, generator=g)[:t].tolist()
    slots[-1] = -1
    if t > 6:
        slots[-2] = n + 5
    slot_mapping = torch.tensor(slots, dtype=slot_dtype)
    mv = mids.to(device) if mids is not None else None
    return preset, (key.to(device), value.to(device), kv_cache.to(device),
                    slot_mapping.to(device), pit.to(device) if preset.mse else None, mv)


def _check(impl, preset_name, dtype, slot_dtype, d, **kw):
    preset, inputs = make_case(preset_name, dtype, slot_dtype, d, **kw)
    _check_inputs(impl, preset, inputs, f"{preset_name} {dtype} {slot_dtype} D={d}")


def tree_order_case(preset_name: str, device="cpu", at=(0, 8, 16, 24),
                    rows=(2.0**25, 2.0, 2.0, -(2.0**25))):
    """A row whose rotation sums differ between the contract's tree and a sum in order: x = 1 at
    i = 0, 8, 16, 24 (D = 64), so u = 0.5 there (n = 2, den = RN(2 + 1e-8) = 2), and PiT rows
    2^25, 2, 2, -2^25 there: the leaves 2^24, 1, 1, -2^24 in four chunks of 8. The tree gives
    (RN(2^24 + 1) + RN(1 - 2^24)) = 2^24 - (2^24 - 1) = 1; in order, 0. A midpoint at 0.5 tells
    them apart. ``at`` and ``rows``: other places and values of the four leaves (times 2)."""
    d = 64
    preset = make_preset(preset_name, d)
    key = torch.zeros(1, 2, d)
    key[0, :, list(at)] = 1.0
    value = torch.linspace(-1, 1, 2 * d).reshape(1, 2, d)
    pit = torch.zeros(d, d)
    for i, r in zip(at, rows, strict=True):
        pit[i] = r
    nm = (1 << preset.key_bits) - 1
    mids = torch.linspace(-3.0, 3.0, nm + 1)[1:] - 0.5 * 6.0 / nm
    mids[nm // 2] = 0.5
    mids = torch.sort(mids).values
    kv_cache = torch.zeros(2, 2, 2, preset.slot_size_aligned, dtype=torch.uint8)
    slots = torch.tensor([3], dtype=torch.int64)
    return preset, tuple(x.to(device) for x in (key, value, kv_cache, slots, pit, mids))


def _check_inputs(impl, preset, inputs, what):
    key, value, kv_cache, slots, pit, mids = inputs
    expected = oracle_write(key.cpu(), value.cpu(), kv_cache.cpu(), slots.cpu(), preset,
                                  None if pit is None else pit.cpu(),
                                  None if mids is None else mids.cpu())
    assert impl.unsupported(key, kv_cache, preset) is None
    impl.run(key, value, kv_cache, slots, preset, pit, mids)
    if key.is_cuda:
        torch.cuda.synchronize()
    assert_written(kv_cache, expected, what)


def _triton():
    from kvwrite.ops.reshape_and_cache_turboquant import triton_impl
    reason = triton_impl.available(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    return triton_impl


# The Triton kernels' launches: "rows" every call on the rows kernel, 64 elements a pass (4
# rows of D = 16, 1 of D >= 64; the k8v4 launch's programs floor lifted), two programs striding
# over the passes (MSE); "program-a-row" every call on _tq_kernel.
TRITON_LAUNCHES = ["rows", "program-a-row"]


def _triton_launch(name, rows_elems=64, programs=2):
    tq = _triton()
    tuning = (dataclasses.replace(tq.TUNING, k8v4_rows_min=0, mse_rows_min=0,
                                  rows_elems=rows_elems, rows_programs=1,
                                  mse_rows_elems=rows_elems, mse_small_rows=0,
                                  mse_programs_per_sm=programs)
              if name == "rows" else
              dataclasses.replace(tq.TUNING, k8v4_rows_min=1 << 62, mse_rows_min=1 << 62))
    return _Tuned(tq, tuning)


@pytest.mark.parametrize("preset_name", MSE_PRESETS)
@pytest.mark.parametrize("d, rows_elems, pit_kind", [(16, 16, "tables"), (16, 256, "tables"),
                                                     (32, 128, "random")])
def test_triton_mse_rows_kernel_block_rows_on_cpu(preset_name, d, rows_elems, pit_kind):
    """The MSE rows kernel at 1 to 16 rows a pass (a last pass part empty), three programs: the
    butterflies (turboquant_tables'), the dense products (a random table)."""
    preset, inputs = table_case(preset_name, d, pit_kind, dtype=torch.float16, t=37, seed=d)
    _check_inputs(_triton_launch("rows", rows_elems, programs=3), preset, inputs,
                  f"{preset_name} D={d} rows_elems={rows_elems}")


# ------------------------------------------------------------------------------------------
# CPU: the oracle itself, Triton's interpreter, NVRTC
# ------------------------------------------------------------------------------------------
def test_oracle_special_rows_follow_the_spec():
    p = make_preset("turboquant_4bit_nc", 8)
    pit, mids = torch.eye(8), torch.linspace(-0.7, 0.7, 15)
    zero, _ = oracle_slot(torch.zeros(8), torch.full((8,), 7.0), p, pit, mids)
    # A zero row: norm 0, idx = #{m_k <= 0} = 8 (0 is the middle midpoint); a constant value
    # row: codes 0, scale 0x0000 (fp16(1e-8)), zero fp16(7) = 0x4700.
    assert zero[4:6] == [0, 0] and zero[0] == 8 | (8 << 4)
    assert zero[6:10] == [0] * 4 and zero[10:14] == [0, 0, 0x00, 0x47]
    nan_row, free = oracle_slot(torch.tensor([1.0, float("nan")] + [0.0] * 6), torch.zeros(8), p,
                                pit, mids)
    assert nan_row[:6] == [0] * 4 + [0x00, 0x7E] and free == [(4, 2)]
    inf_row, _ = oracle_slot(torch.tensor([float("inf")] + [1.0] * 7), torch.zeros(8), p, pit,
                             mids)
    assert inf_row[:6] == [0, 0, 0, 0, 0x00, 0x7C]  # indices 0, norm +inf
    v, _ = oracle_slot(torch.zeros(8), torch.tensor([0.0, 15.0, 7.5, 7.4999995] + [0.0] * 4),
                       p, pit, mids)
    assert v[6:8] == [0xF0, 0x78]  # s = 1: 7.5 -> 8 (half up), 7.4999995 -> 7


def test_cases_write_their_special_rows():
    """The special rows lie on written tokens: a NaN norm, an infinite one, a NaN key code."""
    for name in ("turboquant_4bit_nc", "turboquant_k8v4"):
        preset, (key, value, _, slots, pit, mids) = make_case(name, torch.float32, torch.int64, 8)
        assert (slots[:5] >= 0).all() and (slots[:5] < 16).all() and slots[-1] == -1
        _, nan_fields = oracle_slot(key[1, 0], value[1, 0], preset, pit, mids)
        assert nan_fields
    inf_norm, _ = oracle_slot(key[1, 1], value[1, 1], make_preset("turboquant_4bit_nc", 8),
                              torch.eye(8), torch.zeros(15))
    assert inf_norm[4:6] == [0x00, 0x7C]


PARAMS = [(p, dt, sd, d) for p in PRESETS for dt in (torch.float16, torch.bfloat16, torch.float32)
          for sd in (torch.int32, torch.int64) for d in (8, 16, 64)]


@pytest.mark.parametrize("preset_name, dtype, slot_dtype, d", PARAMS,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_triton_matches_oracle_on_cpu(preset_name, dtype, slot_dtype, d):
    _check(_triton(), preset_name, dtype, slot_dtype, d, seed=d + (slot_dtype == torch.int64))


@pytest.mark.parametrize("launch", TRITON_LAUNCHES)
@pytest.mark.parametrize("preset_name", PRESETS[1:])
@pytest.mark.parametrize("pit_kind", ["hadamard", "identity"])
def test_triton_rotations_and_midpoint_ties_on_cpu(launch, preset_name, pit_kind):
    _check(_triton_launch(launch), preset_name, torch.float32, torch.int64, 16, pit_kind=pit_kind,
           vllm_alloc=False)


@pytest.mark.parametrize("preset_name, d", [("turboquant_k8v4", 10), ("turboquant_4bit_nc", 10),
                                             ("turboquant_4bit_nc", 2), ("turboquant_3bit_nc", 24),
                                             ("turboquant_k3v4_nc", 40)])
@pytest.mark.parametrize("launch", TRITON_LAUNCHES)
def test_triton_odd_byte_fields_and_padded_rows_on_cpu(launch, preset_name, d):
    """D = 10: the 4-bit field ends at an odd byte, the norm and scales sit at odd offsets; D = 2
    (a tree of two leaves), 24 and 40 (rows padded to 32 and 64)."""
    _check(_triton_launch(launch), preset_name, torch.float16, torch.int32, d, special=d >= 8)


class _TritonRows:
    """triton_impl's run with every k8v4 call on the rows kernel, ``rows_elems`` elements a
    program (BLOCK_R = rows_elems // BLOCK_D rows: rows_programs 1 lifts the programs' floor)."""

    def __init__(self, rows_elems: int):
        self.tq = _triton()
        self.tuning = dataclasses.replace(self.tq.TUNING, k8v4_rows_min=0, rows_elems=rows_elems,
                                          rows_programs=1)

    def unsupported(self, key, kv_cache, preset):
        return self.tq.unsupported(key, kv_cache, preset)

    def run(self, key, value, kv_cache, slot_mapping, preset, pit, mids):
        self.tq.run(key, value, kv_cache, slot_mapping, preset, pit, mids, tuning=self.tuning)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("d, rows_elems", [(8, 32), (16, 64), (10, 256), (64, 64)])
def test_triton_rows_kernel_matches_oracle_on_cpu(dtype, slot_dtype, d, rows_elems):
    """The k8v4 rows kernel: 14 rows in programs of 1 to 16 rows (a last one part empty), the
    special rows (NaN, ±inf, ±0, ties), padded rows (D = 10), vLLM's transposed slot cache."""
    _check(_TritonRows(rows_elems), "turboquant_k8v4", dtype, slot_dtype, d,
           seed=d + (slot_dtype == torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda v: str(v).replace("torch.", ""))
def test_triton_rows_kernel_signed_nan_keys_on_cpu(dtype):
    _check_inputs(_TritonRows(64), *signed_nan_key_case(dtype), "rows kernel, signed NaN keys")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda v: str(v)[6:])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("vllm_alloc", [True, False], ids=["words", "unaligned"])
def test_triton_k8v4_word_slots_on_cpu(dtype, d, vllm_alloc):
    """The k8v4 rows kernel at one row a program (rows_elems = D: BLOCK_R 1) stores its slots
    as 4-byte words (word_slots: D a power of two >= 32, every slot 4-byte aligned; the
    unaligned cache takes the byte stores): the special rows, signed NaN keys and
    value-boundary rows, skipped slots, against the oracle."""
    launch = "rows"
    impl = _TritonRows(d)
    preset, inputs = make_case("turboquant_k8v4", dtype, torch.int64, d, t=14, h=2, nb=8,
                               seed=d, vllm_alloc=vllm_alloc)
    assert _triton().word_slots(inputs[2], preset, d) == vllm_alloc
    _check_inputs(impl, preset, inputs, f"{launch} words D={d}")
    if vllm_alloc:
        _check_inputs(impl, *signed_nan_key_case(dtype, d=d), f"{launch} words, NaN keys D={d}")
        _check_inputs(impl, *value_boundary_case("turboquant_k8v4", d, t=8),
                      f"{launch} words, value boundaries D={d}")


def test_triton_rows_per_program():
    """BLOCK_R: the widest power of two within rows_elems while rows_programs programs remain
    (the H200's measured choice: 1 row up to 4095 rows at D = 128, 2 below 8192, then 4)."""
    tq = _triton()
    t = dataclasses.replace(tq.TUNING, rows_elems=512, rows_programs=2048)
    assert [tq.rows_per_program(r, 128, t) for r in (1, 512, 4095, 4096, 8191, 8192, 1 << 20)] == [
        1, 1, 1, 2, 2, 4, 4]
    assert tq.rows_per_program(1 << 20, 16, t) == 32
    assert tq.rows_per_program(1 << 20, 1024, t) == 1
    assert tq.rows_per_program(64, 16, dataclasses.replace(t, rows_programs=1)) == 32


def test_triton_rows_launch():
    """The rows kernel's launch: k8v4 a program a pass from k8v4_rows_min rows; MSE one row a
    pass up to mse_small_rows rows, then BLOCK_R within mse_rows_elems, at most
    mse_programs_per_sm programs an SM striding (the interpreter: one SM)."""
    tq = _triton()
    t = dataclasses.replace(tq.TUNING, k8v4_rows_min=512, rows_elems=512, rows_programs=2048,
                            rows_warps=1, mse_rows_min=0, mse_rows_elems=256,
                            mse_small_rows=512, mse_warps=1, mse_programs_per_sm=16)
    cpu = torch.device("cpu")
    assert tq.rows_launch(511, 128, False, cpu, t) is None
    assert tq.rows_launch(1 << 20, 128, False, cpu, t) == (4, 1 << 18, 1, False)
    assert tq.rows_launch(8, 128, True, cpu, t) == (1, 8, 1, True)
    assert tq.rows_launch(512, 128, True, cpu, t) == (1, 16, 1, True)
    assert tq.rows_launch(513, 128, True, cpu, t) == (2, 16, 1, True)
    assert tq.rows_launch(513, 32, True, cpu, t) == (8, 16, 1, True)
    assert tq.rows_launch(1, 128, True, cpu, dataclasses.replace(t, mse_rows_min=2)) is None


def test_triton_rows_kernel_value_boundaries_on_cpu():
    _check_inputs(_TritonRows(128), *value_boundary_case("turboquant_k8v4", 16, t=8),
                  "rows kernel, value boundaries")


# The CUDA kernel on the CPU: kernel.cu compiled with g++ over tests/gather_emu.h's SIMT
# emulation (one std::thread per CUDA thread, barriers and shuffles emulated; shared arrays as
# function statics: one CTA runs at a time), launched with cuda_impl.launch_args. Not emulated:
# the GPU's own conversions (the satfinite fp8 one, cvt to float16 and back), which take the
# headers' host paths; the GPU tests cover those.
_EMU_HARNESS = r"""
#include "gather_emu.h"
#undef __shared__
#define __shared__ static
inline void __syncwarp(unsigned = 0xFFFFFFFFu) { emu_warp().bar.arrive_and_wait(); }
#include "kernel.cu"
#define TQ_EMU_CTA 128  // gather_emu.h's CTA size (_EMU_CTA)
#define TQ_EMU(IN, KB, VB, ST, E, NAME)                                                     \
  extern "C" void NAME(const u8* k, const u8* v, u8* c, const ST* s, const float* pit,      \
                       const float* mid, const int* fl, i64 nt, i64 rw, i64 nf, i64 H,      \
                       i64 D, i64 P, i64 kt, i64 kh, i64 vt, i64 vh, i64 cb, i64 cp,        \
                       i64 ch, i64 bs, i64 bsh, i64 ns, i64 p0, i64 p1, i64 ms, i64 grid) { \
    emu_launch(static_cast<unsigned>(grid), [&] {                                           \
      tq_kernel<IN, KB, VB, ST, E, TQ_EMU_CTA>(k, v, c, s, pit, mid, fl, nt, rw, nf, H, D,  \
                                               P, kt, kh, vt, vh, cb, cp, ch, bs, bsh, ns,  \
                                               p0, p1, ms);                                 \
    });                                                                                     \
  }
extern "C" void tq_check_emu(const float* pit, i64 D, i64 p0, i64 p1, int* fl, i64 grid) {
  emu_launch(static_cast<unsigned>(grid),
             [&] { tq_check_kernel<TQ_EMU_CTA>(pit, D, p0, p1, fl); });
}
#define TQ_SPLIT_EMU(IN, KB, VB, ST, E, NAME)                                               \
  extern "C" void NAME(const u8* k, const u8* v, u8* c, const ST* s, const float* pit,      \
                       const float* mid, i64 nt, i64 H, i64 D, i64 P, i64 kt, i64 kh,       \
                       i64 vt, i64 vh, i64 cb, i64 cp, i64 ch, i64 bs, i64 bsh, i64 ns,     \
                       i64 p0, i64 p1, i64 ms, i64 grid) {                                  \
    emu_launch(static_cast<unsigned>(grid), [&] {                                           \
      tq_split_kernel<IN, KB, VB, ST, E, TQ_EMU_CTA>(k, v, c, s, pit, mid, nt, H, D, P, kt, \
                                                     kh, vt, vh, cb, cp, ch, bs, bsh, ns,   \
                                                     p0, p1, ms);                           \
    });                                                                                     \
}
"""


def _emu_name(kind: int, kb: int, vb: int, slot_dtype, e: int) -> str:
    return f"tq_{kind}_{kb}_{vb}_{64 if slot_dtype == torch.int64 else 32}_{e}"


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    from kvwrite.kernels import launch
    lines = [_EMU_HARNESS]
    for kind in launch.KIND.values():
        for kb, vb in _BITS.values():
            for sd, st in ((torch.int32, "int"), (torch.int64, "long long")):
                for e in _EMU_ELEMS:
                    if e < 8 and 3 in (kb, vb):
                        continue
                    lines.append(f"TQ_EMU({kind}, {kb}, {vb}, {st}, {e}, "
                                 f"{_emu_name(kind, kb, vb, sd, e)})")
                for e in (2, 4) if kb != 8 else ():
                    lines.append(f"TQ_SPLIT_EMU({kind}, {kb}, {vb}, {st}, {e}, "
                                 f"split_{_emu_name(kind, kb, vb, sd, e)})")
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl
    return build_emu_lib(tmp_path_factory, "\n".join(lines) + "\n", "tqemu",
                         pathlib.Path(cuda_impl.__file__).parent)


# The emulated E variants: every one run picks (the tuning's lane_elems is overridden per test
# to put more lanes on a row).
_EMU_ELEMS = (2, 4, 8, 16, 32)
_EMU_CTA = 128  # gather_emu.h's CTA size


class _Emulated:
    """cuda_impl's run, the kernel emulated on the CPU: ``lane_elems`` the tuning's (fewer
    elements a lane: more lanes a row, more shuffle levels), ``sm_count`` the resident CTAs, the
    grid's bound (1: one CTA strides over every row)."""

    def __init__(self, lib, lane_elems: int = 16, sm_count: int = 2, small_rows: int = 0,
                 small_lane_elems: int = 4, warps: int | None = None, check_rows: int = 4096,
                 split_warps: int = 0):
        from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl
        self.lib, self.c = lib, cuda_impl
        # small_rows 0: every call takes lane_elems (the small-call choice has its own test)
        # check_rows: calls of at most that many rows take the table check's kernel (0: each
        # CTA checks the table itself); split_warps: the MSE presets' calls of at most that many
        # warps take tq_split_kernel (0: none, tq_kernel is what the test is about)
        self.tuning = cuda_impl.CudaTuning(lane_elems=lane_elems, small_rows=small_rows,
                                           small_lane_elems=small_lane_elems,
                                           check_rows=check_rows, split_warps=split_warps)
        self.sm_count = sm_count
        self.warps = warps  # the warps with rows a CTA (None: cuda_impl.row_warps's)

    def unsupported(self, key, kv_cache, preset):
        return self.c.unsupported(key, kv_cache, preset)

    def run(self, key, value, kv_cache, slot_mapping, preset, pit, mids):
        from kvwrite.kernels import launch
        d, rows, least = key.shape[2], slot_mapping.numel() * key.shape[1], self.c.min_elems(preset)
        se = self.c.split_elems(int(preset.key_bits), d, rows, self.tuning)
        if se:  # as run: the split kernel alone
            args = self.c.split_args(key, value, kv_cache, slot_mapping, pit, mids)
            fn = getattr(self.lib, "split_" + _emu_name(launch.KIND[key.dtype], preset.key_bits,
                                                        preset.value_bits, slot_mapping.dtype, se))
            fn(*(ctypes.c_void_p(a) for a in args[:6]),
               *(ctypes.c_longlong(a) for a in args[6:]),
               ctypes.c_longlong(self.c.split_grid(rows, d)))
            return
        e, lpr = self.c.lanes(d, self.tuning, rows, least)
        warps = self.warps or self.c.row_warps(int(preset.key_bits), e, lpr, rows, _EMU_CTA,
                                               self.sm_count, self.tuning)
        flags, n = None, self.c.check_ctas(int(preset.key_bits), d, rows, self.tuning, _EMU_CTA)
        if n:  # the table check first, as run launches it
            flags = torch.full((n,), -1, dtype=torch.int32)
            self.lib.tq_check_emu(ctypes.c_void_p(pit.data_ptr()), ctypes.c_longlong(d),
                                  *(ctypes.c_longlong(x) for x in pit.stride()),
                                  ctypes.c_void_p(flags.data_ptr()), ctypes.c_longlong(n))
            assert set(flags.tolist()) <= {0, 1}, "every check CTA writes its flag"
        args = self.c.launch_args(key, value, kv_cache, slot_mapping, preset, pit, mids, warps,
                                  flags)
        fn = getattr(self.lib, _emu_name(launch.KIND[key.dtype], preset.key_bits,
                                         preset.value_bits, slot_mapping.dtype, e))
        grid = self.c.grid(rows, d, self.sm_count, _EMU_CTA, self.tuning, least=least,
                           warps=warps)
        fn(*(ctypes.c_void_p(a) for a in args[:7]),
           *(ctypes.c_longlong(a) for a in args[7:]), ctypes.c_longlong(grid))


EMU_PARAMS = [(p, dt, sd, d) for p in PRESETS for dt in (torch.float16, torch.bfloat16, torch.float32)
              for sd in (torch.int32, torch.int64) for d in (8, 16)]


@pytest.mark.parametrize("preset_name, dtype, slot_dtype, d", EMU_PARAMS,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_cuda_kernel_emulated_matches_oracle(emu_lib, preset_name, dtype, slot_dtype, d):
    _check(_Emulated(emu_lib), preset_name, dtype, slot_dtype, d,
           seed=d + (slot_dtype == torch.int64), h=2)


@pytest.mark.parametrize("preset_name, d, pit_kind", [
    ("turboquant_4bit_nc", 64, "random"), ("turboquant_3bit_nc", 24, "random"), ("turboquant_3bit_nc", 32, "hadamard"),
    ("turboquant_k3v4_nc", 16, "identity"), ("turboquant_4bit_nc", 10, "random"),
    ("turboquant_k8v4", 10, "random"), ("turboquant_4bit_nc", 4, "random"),
    ("turboquant_4bit_nc", 2, "random")])
def test_cuda_kernel_emulated_shapes_and_ties(emu_lib, preset_name, d, pit_kind):
    """Trees of one to 8 chunks of leaves, odd-byte fields, padded head sizes, midpoint ties."""
    _check(_Emulated(emu_lib), preset_name, torch.float32, torch.int64, d, h=2,
           pit_kind=pit_kind, vllm_alloc=False, special=d >= 8)


@pytest.mark.parametrize("preset_name", PRESETS)
@pytest.mark.parametrize("d, small_lane_elems", [(16, 8), (128, 8), (128, 4)])
def test_cuda_kernel_emulated_small_call_lanes(emu_lib, preset_name, d, small_lane_elems):
    """Small calls with small_lane_elems a lane (8: 16 lanes a row at D = 128; 4: 32, but 8
    for 3-bit fields), as the launcher picks them at most small_rows rows."""
    _check(_Emulated(emu_lib, small_rows=1 << 20, small_lane_elems=small_lane_elems),
           preset_name, torch.bfloat16, torch.int64, d, h=2, seed=d + 1)


# The kernel's two rotation paths (the Hadamard table by the fast Walsh-Hadamard transform, any
# other by the products' trees) and its two midpoint counts (a binary search where the midpoints
# ascend), chosen per CTA from the tables' values.
def table_variant(d: int, preset_name: str, pit_kind: str, mids_kind: str, seed: int = 0):
    """(PiT, midpoints) of a kind: pit_kind "tables" (turboquant_tables': the Hadamard path),
    "negated" (-PiT: h < 0, still Hadamard), "strided" (the same values column-major: read one by
    one), "offset" (a view one float off 16-byte alignment), "zero" (±0 in the Sylvester signs),
    "ulp" / "sign" / "corner" (one entry one ulp off, its sign flipped, PiT[D-1, D-1] off: the
    generic path), "random"; mids_kind "tables", "unsorted", "nan" (a NaN midpoint), "dup" (equal
    neighbours)."""
    from kvwrite import turboquant_tables
    g = torch.Generator().manual_seed(seed)
    pit, _, mids = turboquant_tables(d, preset_name)
    if pit_kind == "negated":
        pit = -pit
    elif pit_kind == "strided":
        pit = pit.t().contiguous().t()
    elif pit_kind == "offset":
        buf = torch.empty(d * d + 1)
        buf[1:] = pit.flatten()
        pit = buf[1:].view(d, d)
    elif pit_kind == "zero":
        pit = pit * 0.0  # +0 where the sign is +, -0 where it is -
    elif pit_kind in ("ulp", "sign", "corner"):
        pit = pit.clone()
        i, j = (d - 1, d - 1) if pit_kind == "corner" else torch.randint(0, d, (2,), generator=g)
        if pit_kind == "sign":
            pit[i, j] = -pit[i, j]
        else:
            pit.view(torch.int32)[i, j] += 1
    elif pit_kind == "random":
        pit = torch.randn(d, d, generator=g) / math.sqrt(d)
    if mids_kind == "unsorted":
        mids = mids[torch.randperm(mids.numel(), generator=g)]
    elif mids_kind == "nan":
        mids = mids.clone()
        mids[mids.numel() // 2] = float("nan")
    elif mids_kind == "dup":
        mids = mids.clone()
        mids[1] = mids[2]
        mids[-1] = mids[-2]
    return pit, mids


def table_case(preset_name, d, pit_kind="tables", mids_kind="tables", *, dtype=torch.float32,
               t=7, h=2, seed=0, device="cpu"):
    """make_case's rows (special ones included) with table_variant's tables and rows whose
    butterflies cancel exactly (constant, alternating, one-hot, two equal entries), in written
    tokens 3 and 4."""
    preset, (key, value, kv_cache, slots, _, _) = make_case(
        preset_name, dtype, torch.int64, d, t=t, h=h, nb=t // 4 + 2, seed=seed, special=d >= 8,
        vllm_alloc=seed % 2 == 0)
    pit = mids = None
    if preset.mse:
        pit, mids = table_variant(d, preset_name, pit_kind, mids_kind, seed)
    key[3, 0] = 1.0
    key[3, 1] = torch.tensor([1.0, -1.0] * (d // 2)).to(dtype)
    key[4, 1] = 0.0
    key[4, 1, d // 2] = -2.5
    key[4, 1, 0] = 2.5
    key[4, 0, : d // 2] = -0.0
    pit, mids = (None if x is None else x.to(device) for x in (pit, mids))
    return preset, (key.to(device), value.to(device), kv_cache.to(device), slots.to(device),
                    pit, mids)


HADAMARD_PARAMS = ([(p, d, le) for p in MSE_PRESETS for d in (16, 32, 64, 128, 256) for le in (16, 8)]
                   + [("turboquant_4bit_nc", d, 16) for d in (2, 4, 8)])


@pytest.mark.parametrize("preset_name, d, lane_elems", HADAMARD_PARAMS)
def test_cuda_kernel_emulated_hadamard_path(emu_lib, preset_name, d, lane_elems):
    """turboquant_tables' PiT (the butterflies) at D = 2 ... 256, 1 to 32 lanes a row."""
    preset, inputs = table_case(preset_name, d, seed=d)
    _check_inputs(_Emulated(emu_lib, lane_elems=lane_elems), preset, inputs,
                  f"{preset_name} D={d} E<={lane_elems}")


TABLE_KINDS = [("negated", "tables"), ("strided", "unsorted"), ("offset", "dup"),
               ("zero", "tables"), ("ulp", "tables"), ("sign", "nan"), ("corner", "dup"),
               ("random", "unsorted"), ("tables", "nan"), ("tables", "unsorted")]


@pytest.mark.parametrize("preset_name", MSE_PRESETS)
@pytest.mark.parametrize("pit_kind, mids_kind", TABLE_KINDS)
@pytest.mark.parametrize("check_rows", [0, 4096])
def test_cuda_kernel_emulated_table_variants(emu_lib, preset_name, pit_kind, mids_kind,
                                             check_rows):
    """Tables near the Hadamard (the generic path) or the Hadamard read another way, midpoints
    out of order (the count itself), D = 64 over 8 lanes; the table checked by each CTA (0) or
    by the check's kernel (4096)."""
    preset, inputs = table_case(preset_name, 64, pit_kind, mids_kind, seed=3)
    _check_inputs(_Emulated(emu_lib, lane_elems=8, check_rows=check_rows), preset, inputs,
                  f"{preset_name} {pit_kind} {mids_kind} check_rows={check_rows}")


@pytest.mark.parametrize("preset_name, pit_kind", [("turboquant_k8v4", "tables"),
                                                   ("turboquant_4bit_nc", "tables"),
                                                   ("turboquant_3bit_nc", "random")])
def test_cuda_kernel_emulated_grid_strides(emu_lib, preset_name, pit_kind):
    """One CTA striding over 300 tokens x 2 heads (several passes of its warps; bf16 rows)."""
    preset, inputs = table_case(preset_name, 32, pit_kind, dtype=torch.bfloat16, t=300, seed=4)
    _check_inputs(_Emulated(emu_lib, sm_count=1), preset, inputs, f"{preset_name} strided grid")


@pytest.mark.parametrize("preset_name, d", [(p, d) for p in MSE_PRESETS for d in (16, 32, 64, 128)]
                         + [("turboquant_4bit_nc", d) for d in (2, 4, 8, 256)])
@pytest.mark.parametrize("launch", TRITON_LAUNCHES)
def test_triton_hadamard_path_on_cpu(launch, preset_name, d):
    """turboquant_tables' PiT (the butterflies) under the interpreter."""
    preset, inputs = table_case(preset_name, d, seed=d)
    _check_inputs(_triton_launch(launch), preset, inputs, f"{preset_name} D={d}")


@pytest.mark.parametrize("preset_name", MSE_PRESETS)
@pytest.mark.parametrize("pit_kind, mids_kind", TABLE_KINDS)
@pytest.mark.parametrize("launch", TRITON_LAUNCHES)
def test_triton_table_variants_on_cpu(launch, preset_name, pit_kind, mids_kind):
    preset, inputs = table_case(preset_name, 32, pit_kind, mids_kind, seed=3)
    _check_inputs(_triton_launch(launch), preset, inputs, f"{preset_name} {pit_kind} {mids_kind}")


@pytest.mark.parametrize("preset_name, pit_kind", [("turboquant_k8v4", "tables"),
                                                   ("turboquant_4bit_nc", "tables"),
                                                   ("turboquant_3bit_nc", "random")])
@pytest.mark.parametrize("launch", TRITON_LAUNCHES)
def test_triton_programs_stride_on_cpu(launch, preset_name, pit_kind):
    """300 tokens x 2 heads (bf16 rows): the rows kernel's two programs striding over 300
    passes, or a program a row."""
    preset, inputs = table_case(preset_name, 32, pit_kind, dtype=torch.bfloat16, t=300, seed=4)
    _check_inputs(_triton_launch(launch), preset, inputs, f"{preset_name} strided grid")


def stress_case(preset_name, d, t=150, h=2, seed=0, device="cpu"):
    """Rows made to cancel and tie: small integers, a few special values (±0, ±inf, NaN, 1e-30,
    1e30, 65504) sprinkled in, some plain normal rows; vLLM's Hadamard table; midpoints taken
    from the y_j of written rows (so some y_j equal a midpoint exactly), ascending."""
    g = torch.Generator().manual_seed(seed)
    preset, (key, value, kv_cache, slots, _, _) = make_case(
        preset_name, torch.float32, torch.int64, d, t=t, h=h, nb=t // 4 + 2, seed=seed,
        special=False)
    n = key.shape[0] * h
    kind = torch.randint(0, 4, (n,), generator=g)
    ints = torch.randint(-3, 4, (n, d), generator=g).float()
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-30, 1e30,
                             65504.0, 1.0, -1.0, 0.5])
    pick = specials[torch.randint(0, specials.numel(), (n, d), generator=g)]
    sprinkle = torch.rand(n, d, generator=g) < 0.02
    rows = torch.where((kind == 0)[:, None], ints,
                       torch.where((kind == 1)[:, None], torch.where(sprinkle, pick, ints),
                                   torch.where((kind == 2)[:, None], ints.sign() * 0.0,
                                               torch.randn(n, d, generator=g))))
    key = rows.reshape(key.shape[0], h, d).clone()
    value = torch.where(sprinkle, pick, ints).reshape(key.shape[0], h, d).clone()
    from kvwrite import turboquant_tables
    pit, _, _ = turboquant_tables(d, preset_name)
    nm = (1 << preset.key_bits) - 1
    ys = []
    for r in range(4):
        x = key[r // h, r % h]
        den = _f32(math.sqrt(_tree(x * x).item())) + _f32(EPS)
        y = _tree((x / den)[:, None] * pit)
        ys += [v for v in y.tolist() if math.isfinite(v)]
    mids = torch.tensor(sorted(set(ys))[:: max(1, len(set(ys)) // nm)][:nm])
    if mids.numel() < nm:
        mids = torch.cat([mids, torch.linspace(1.0, 2.0, nm - mids.numel())])
    mids = mids.sort().values
    return preset, tuple(x.to(device) for x in (key, value, kv_cache, slots, pit, mids))


@pytest.mark.parametrize("preset_name", MSE_PRESETS)
@pytest.mark.parametrize("d, lane_elems", [(64, 8), (32, 16), (16, 16)])
def test_cuda_kernel_emulated_hadamard_stress(emu_lib, preset_name, d, lane_elems):
    """The butterflies against the tree on rows that cancel exactly (signed zeros), carry
    specials, and land on midpoints."""
    preset, inputs = stress_case(preset_name, d, seed=d)
    _check_inputs(_Emulated(emu_lib, lane_elems=lane_elems), preset, inputs,
                  f"{preset_name} D={d} stress")


@pytest.mark.parametrize("preset_name, d, pit_kind", [
    ("turboquant_4bit_nc", 512, "tables"), ("turboquant_3bit_nc", 1024, "tables"),
    ("turboquant_k3v4_nc", 1024, "random"), ("turboquant_k8v4", 1024, "tables")])
def test_cuda_kernel_emulated_long_rows(emu_lib, preset_name, d, pit_kind):
    """32 lanes a row: E = 16 at D = 512, E = 32 at D = 1024 (the CTA's shared rows at their
    largest), both rotation paths."""
    preset, inputs = table_case(preset_name, d, pit_kind, t=4, h=2, seed=1)
    _check_inputs(_Emulated(emu_lib), preset, inputs, f"{preset_name} D={d} {pit_kind}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "cuda-wide", "triton"])
@pytest.mark.parametrize("preset_name", MSE_PRESETS)
@pytest.mark.parametrize("d", [16, 64, 128])
def test_gpu_hadamard_stress(impl, preset_name, d):
    preset, inputs = stress_case(preset_name, d, t=400, h=4, seed=d, device="cuda")
    _check_inputs(_gpu_impl(impl), preset, inputs, f"{preset_name} D={d} stress")


def value_boundary_case(preset_name, d, t=24, h=4, seed=0, device="cpu"):
    """Value rows whose quotients (v - mn) / s lie within a few ulps of the code boundaries
    n + 1/2 (where a product by RN(1 / s) alone would round to the wrong code; the CUDA kernel
    decides them by an FMA against the boundary): per row a random mn, a range that is not a
    power of two, s as the contract rounds it; each element RN(mn + RN((n + 1/2) s)) moved by
    -3..3 ulps (n random below L), the row's min and max among them. Keys: normal rows."""
    g = torch.Generator().manual_seed(seed)
    preset, (key, value, kv_cache, slots, pit, mids) = make_case(
        preset_name, torch.float32, torch.int64, d, t=t, h=h, nb=t // 4 + 2, seed=seed,
        special=False, device=device)
    big_l = float((1 << preset.value_bits) - 1)
    n_rows = value.shape[0] * h
    mn = (torch.randn(n_rows, 1, generator=g) * 4).float()
    rng = (torch.rand(n_rows, 1, generator=g) * 30 + 0.01).float()
    mx = (mn + rng).float()
    s = ((mx - mn) / big_l).float()  # float32 ops, each correctly rounded
    n = torch.randint(0, int(big_l), (n_rows, d), generator=g).float()
    v = (mn + ((n + 0.5) * s).float()).float()
    for _ in range(3):  # up to 3 ulps either way, each element its own
        step = torch.randint(-1, 2, (n_rows, d), generator=g)
        v = torch.where(step > 0, torch.nextafter(v, torch.tensor(math.inf)),
                        torch.where(step < 0, torch.nextafter(v, torch.tensor(-math.inf)), v))
    v = torch.minimum(torch.maximum(v, mn), mx)
    v[:, 0], v[:, 1] = mn[:, 0], mx[:, 0]
    # Every fourth row: min 0, and a ladder of the floats within 16 ulps either side of s / 2
    # (quotients on both sides of 1/2's rounding interval, whose lower end is half the gap
    # below 1/2: the one boundary whose gap below differs from the gap above); every eighth with
    # s a power of two (range 15 * 2^j), the one case where a quotient, pred(1/2), falls between
    # pred(1/2) and that lower end.
    for r in range(0, n_rows, 4):
        if r % 8 == 0:
            s[r, 0] = 2.0 ** torch.round(torch.log2(s[r, 0]))
            mx[r, 0], mn[r, 0] = s[r, 0] * big_l, 0.0
        half = (s[r, 0] * 0.5).float()
        ladder = [half]
        for _ in range(16):
            ladder = [torch.nextafter(ladder[0], torch.tensor(-math.inf))] + ladder + \
                     [torch.nextafter(ladder[-1], torch.tensor(math.inf))]
        rungs = torch.stack(ladder)
        v[r] = rungs[torch.arange(d) % rungs.numel()]
        v[r, 0], v[r, 1] = 0.0, mx[r, 0] - mn[r, 0]
    value = v.reshape(value.shape[0], h, d).to(device)
    return preset, (key, value, kv_cache, slots, pit, mids)


def test_value_boundary_case_lands_near_the_boundaries():
    """The case does what it says: most quotients within 8 ulps of an n + 1/2."""
    preset, (key, value, *_) = value_boundary_case("turboquant_k8v4", 16)
    big_l = 15.0
    v = value.reshape(-1, 16).double()
    mn, mx = v.min(1, keepdim=True).values, v.max(1, keepdim=True).values
    s = ((mx.float() - mn.float()) / big_l).float().double()
    q = (v.float() - mn.float()).double() / s
    off = (q - q.floor() - 0.5).abs() / (2.0**-20)
    assert (off[:, 2:] <= 8).float().mean() > 0.9


def _stage_passes() -> int:
    """kernel.cu's TQ_STAGE_PASSES: k8v4 stages its stores past that many passes a warp."""
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl
    text = (pathlib.Path(cuda_impl.__file__).parent / "kernel.cu").read_text()
    return int(re.search(r"#define TQ_STAGE_PASSES (\d+)", text).group(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda v: str(v)[6:])
@pytest.mark.parametrize("d, lane_elems", [(128, 16), (128, 8), (16, 8), (24, 8), (1024, 16)])
@pytest.mark.parametrize("vllm_alloc", [True, False], ids=["vllm", "unaligned"])
def test_cuda_kernel_emulated_k8v4_staged_stores(emu_lib, dtype, d, lane_elems, vllm_alloc):
    """k8v4 calls of more than TQ_STAGE_PASSES passes a warp (one CTA striding over the rows)
    store each warp's slots through shared memory where every slot is 4-byte aligned and the
    rows whole (D a power of two, E = 8 to 32; D = 24 and the unaligned cache take the lanes'
    own stores): the same bytes, the special rows and the skipped slots included."""
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl
    h = 2
    impl = _Emulated(emu_lib, lane_elems=lane_elems, sm_count=1)
    _, lpr = cuda_impl.lanes(d, impl.tuning, 1 << 20)
    per_pass = _EMU_CTA // lpr  # rows of one CTA a pass
    t = (_stage_passes() * per_pass) // h + 3
    rows = t * h
    assert cuda_impl.grid(rows, d, 1, _EMU_CTA, impl.tuning) == 1
    assert rows > _stage_passes() * per_pass, "the case must take the staged path's passes"
    preset, inputs = make_case("turboquant_k8v4", dtype, torch.int64, d, t=t, h=h,
                               nb=-(-t // 4) + 1, bs=4, seed=d + t, vllm_alloc=vllm_alloc)
    _check_inputs(impl, preset, inputs, f"k8v4 staged D={d} E={lane_elems} {dtype}")


@pytest.mark.parametrize("preset_name", ["turboquant_4bit_nc", "turboquant_3bit_nc",
                                         "turboquant_k8v4"])
@pytest.mark.parametrize("warps", [1, 2])
@pytest.mark.parametrize("sm_count", [1, 64])
@pytest.mark.parametrize("check_rows", [0, 4096])
def test_cuda_kernel_emulated_row_warps(emu_lib, preset_name, warps, sm_count, check_rows):
    """CTAs whose first ``warps`` warps take rows (the others only share the setup): many CTAs
    of a few rows each, or one CTA striding over every row; the same bytes, skipped slots
    included (the table is the Hadamard, checked by every warp of each CTA (check_rows 0) or by
    the check's kernel, its flags read by every warp)."""
    impl = _Emulated(emu_lib, lane_elems=8, sm_count=sm_count, small_rows=1 << 20,
                     small_lane_elems=8, warps=warps, check_rows=check_rows)
    _check(impl, preset_name, torch.bfloat16, torch.int64, 64, t=37, h=3, nb=12, bs=4,
           seed=warps + sm_count, pit_kind="hadamard")


# A build with one call's fixed arguments compiled in, as a specialized launch builds it
# (KVWRITE_FIXED_ARGS in FIXED_ARGS' order, ahead of kernel.cu): the variants that call takes.
@pytest.mark.parametrize("preset_name, dtype, slot_dtype, d, split", [
    ("turboquant_k8v4", torch.bfloat16, torch.int64, 64, False),
    ("turboquant_4bit_nc", torch.float16, torch.int32, 64, False),
    ("turboquant_3bit_nc", torch.bfloat16, torch.int64, 56, True),
    ("turboquant_k3v4_nc", torch.float32, torch.int32, 128, True)],
    ids=lambda v: str(v).replace("torch.", ""))
def test_cuda_specialized_build_emulated_matches_oracle(tmp_path_factory, preset_name, dtype,
                                                        slot_dtype, d, split):
    """tq_kernel (with the table check where the table is a Hadamard's) and tq_split_kernel
    built for one call's fixed arguments write the oracle's bytes; the same library given
    another call's (the value's token stride off by one) does not."""
    from kvwrite.kernels import launch
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl
    preset, inputs = make_case(preset_name, dtype, slot_dtype, d, h=3, seed=d,
                               pit_kind="hadamard" if d & (d - 1) == 0 else "random",
                               vllm_alloc=d != 56)
    key, value, kv_cache, slots, pit, mids = inputs  # k8v4: no tables (None), as the op passes
    fixed = cuda_impl.fixed_args(key, value, kv_cache, pit, mids)
    assert len(fixed) == len(cuda_impl.FIXED_ARGS) == 16
    kind, st = launch.KIND[dtype], launch.int_type(slot_dtype)
    kb, vb = int(preset.key_bits), int(preset.value_bits)
    lines = [f"TQ_EMU({kind}, {kb}, {vb}, {st}, {e}, {_emu_name(kind, kb, vb, slot_dtype, e)})"
             for e in _EMU_ELEMS if e >= cuda_impl.min_elems(preset)]
    if split:
        lines += [f"TQ_SPLIT_EMU({kind}, {kb}, {vb}, {st}, {e}, "
                  f"split_{_emu_name(kind, kb, vb, slot_dtype, e)})" for e in (2, 4)]
    op_dir = pathlib.Path(cuda_impl.__file__).parent

    def lib(values):
        head = f"#define KVWRITE_FIXED_ARGS {','.join(str(v) for v in values)}\n"
        return build_emu_lib(tmp_path_factory, head + _EMU_HARNESS + "\n".join(lines) + "\n",
                             "tqfixed", op_dir)

    emulated = _Emulated(lib(fixed), split_warps=1 << 20 if split else 0)
    _check_inputs(emulated, preset, inputs, f"specialized {preset_name} D={d}")
    other = list(fixed)
    other[cuda_impl.FIXED_ARGS.index("v_tok")] += 1
    _, again = make_case(preset_name, dtype, slot_dtype, d, h=3, seed=d,
                         pit_kind="hadamard" if d & (d - 1) == 0 else "random",
                         vllm_alloc=d != 56)
    with pytest.raises(AssertionError):
        _check_inputs(_Emulated(lib(other), split_warps=emulated.tuning.split_warps), preset,
                      again, "another call's build")


# The MSE presets' small calls on tq_split_kernel: a row's outputs 8 a warp, every table by
# the products' trees, the midpoints counted (no order assumed). P = 64, 128 (E = 2, 4), padded
# head sizes (D = 34, 40, 56, 100, 120: the last slice's outputs partly past D).
SPLIT_PARAMS = [(p, dt, sd, d) for p in MSE_PRESETS for dt, sd, d in (
    (torch.bfloat16, torch.int64, 128), (torch.float16, torch.int32, 64),
    (torch.float32, torch.int32, 56), (torch.bfloat16, torch.int32, 40),
    (torch.float32, torch.int64, 120))] + [
    ("turboquant_4bit_nc", torch.float16, torch.int64, 34),
    ("turboquant_4bit_nc", torch.bfloat16, torch.int64, 100)]


@pytest.mark.parametrize("preset_name, dtype, slot_dtype, d", SPLIT_PARAMS,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_cuda_split_kernel_emulated_matches_oracle(emu_lib, preset_name, dtype, slot_dtype, d):
    """Special rows, skipped slots, both cache allocations, the Hadamard (D = 128) or a random
    table (row-major: the two 16-byte loads a row; the table read entry by entry is
    test_cuda_split_kernel_emulated_table_variants' "strided" and "offset")."""
    _check(_Emulated(emu_lib, split_warps=1 << 20), preset_name, dtype, slot_dtype, d, h=2,
           seed=d, pit_kind="hadamard" if d == 128 else "random", vllm_alloc=d % 5 != 0)


@pytest.mark.parametrize("preset_name", MSE_PRESETS)
@pytest.mark.parametrize("pit_kind, mids_kind", TABLE_KINDS)
def test_cuda_split_kernel_emulated_table_variants(emu_lib, preset_name, pit_kind, mids_kind):
    """The tables of test_cuda_kernel_emulated_table_variants (read by rows, column-major, off
    16-byte alignment; midpoints out of order, NaN, tied), D = 64."""
    preset, inputs = table_case(preset_name, 64, pit_kind, mids_kind, seed=3)
    _check_inputs(_Emulated(emu_lib, split_warps=1 << 20), preset, inputs,
                  f"split {preset_name} {pit_kind} {mids_kind}")


# Leaves 2^24, 1, -2^24, 1 in lanes 0, 8, 16, 24 (D = 64, E = 2): the tree's last two levels
# give RN(2^24 + 1) + RN(1 - 2^24) = 1; joined at distance 16 before 8, 0 + 2. The same in lanes
# 0 to 3: the reduce-scatter's first two distances.
SPLIT_TREE_CASES = [{}, {"at": (0, 16, 32, 48), "rows": (2.0**25, 2.0, -(2.0**25), 2.0)},
                    {"at": (0, 2, 4, 6), "rows": (2.0**25, 2.0, -(2.0**25), 2.0)}]


@pytest.mark.parametrize("preset_name", MSE_PRESETS)
@pytest.mark.parametrize("case", range(len(SPLIT_TREE_CASES)))
def test_cuda_split_kernel_emulated_sums_by_the_tree(emu_lib, preset_name, case):
    _check_inputs(_Emulated(emu_lib, split_warps=1 << 20),
                  *tree_order_case(preset_name, **SPLIT_TREE_CASES[case]), "split, tree order")


@pytest.mark.parametrize("preset_name", PRESETS)
@pytest.mark.parametrize("d, lane_elems", [(16, 16), (128, 16), (64, 4)])
def test_cuda_kernel_emulated_value_boundaries(emu_lib, preset_name, d, lane_elems):
    preset, inputs = value_boundary_case(preset_name, d, seed=d + lane_elems)
    if 3 in (preset.key_bits, preset.value_bits):
        lane_elems = max(lane_elems, 8)  # 3-bit fields: whole bytes a lane
    _check_inputs(_Emulated(emu_lib, lane_elems=lane_elems), preset, inputs,
                  f"{preset_name} D={d} value boundaries")


def signed_nan_key_case(dtype, d=16, device="cpu"):
    """k8v4 keys with NaNs of both signs (and ±inf, ±448's neighbours, ±0) at every position
    of a lane's words: every code must be e4m3fn's, a NaN 0x7F whatever its sign."""
    preset, (key, value, kv_cache, slots, pit, mids) = make_case(
        "turboquant_k8v4", dtype, torch.int64, d, t=8, h=2, special=False)
    pattern = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 464.0,
                            -500.0, -0.0, 1.0]).to(dtype)
    n = key.shape[0] * 2
    for r in range(n):
        key[r // 2, r % 2] = pattern.roll(r)[torch.arange(d) % 8]
    bits = key.view(torch.int16 if dtype != torch.float32 else torch.int32)
    assert (bits < 0).logical_and(key.isnan()).any(), "a NaN with its sign bit set"
    return preset, (key.to(device), value.to(device), kv_cache.to(device), slots.to(device),
                    pit, mids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda v: str(v).replace("torch.", ""))
def test_cuda_kernel_emulated_signed_nan_keys(emu_lib, dtype):
    _check_inputs(_Emulated(emu_lib), *signed_nan_key_case(dtype), f"{dtype} signed NaN keys")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v)[6:])
def test_gpu_signed_nan_keys(impl, dtype):
    _check_inputs(_gpu_impl(impl), *signed_nan_key_case(dtype, d=128, device="cuda"),
                  "signed NaN keys")


@pytest.mark.parametrize("launch", TRITON_LAUNCHES)
@pytest.mark.parametrize("preset_name", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_triton_value_boundaries_on_cpu(launch, preset_name):
    _check_inputs(_triton_launch(launch), *value_boundary_case(preset_name, 16, t=8), "value boundaries")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_PATHS)
@pytest.mark.parametrize("preset_name", PRESETS)
def test_gpu_value_boundaries(impl, preset_name):
    preset, inputs = value_boundary_case(preset_name, 128, t=300, seed=3, device="cuda")
    _check_inputs(_gpu_impl(impl), preset, inputs, f"{preset_name} value boundaries")


@pytest.mark.parametrize("launch", TRITON_LAUNCHES)
@pytest.mark.parametrize("preset_name", MSE_PRESETS)
def test_triton_hadamard_stress_on_cpu(launch, preset_name):
    preset, inputs = stress_case(preset_name, 32, seed=5)
    _check_inputs(_triton_launch(launch), preset, inputs, f"{preset_name} stress")


def test_tree_order_case_separates_the_tree_from_a_sum_in_order():
    preset, (key, value, kv_cache, slots, pit, mids) = tree_order_case("turboquant_4bit_nc")
    data, _ = oracle_slot(key[0, 0], value[0, 0], preset, pit, mids)
    leaves = torch.zeros(64)
    leaves[[0, 8, 16, 24]] = torch.tensor([2.0**24, 1.0, 1.0, -(2.0**24)])
    in_order = _f32(0.0)
    for v in leaves:
        in_order = in_order + v  # one float32 RN each
    assert _tree(leaves).item() == 1.0 and in_order.item() == 0.0
    assert data[0] & 15 == int((mids <= 1.0).sum()) != int((mids <= 0.0).sum())


@pytest.mark.parametrize("launch", TRITON_LAUNCHES)
@pytest.mark.parametrize("preset_name", PRESETS[1:])
def test_triton_sums_by_the_tree_on_cpu(launch, preset_name):
    _check_inputs(_triton_launch(launch), *tree_order_case(preset_name), "tree order")


@pytest.mark.parametrize("preset_name", PRESETS[1:])
def test_cuda_kernel_emulated_sums_by_the_tree(emu_lib, preset_name):
    _check_inputs(_Emulated(emu_lib), *tree_order_case(preset_name), "tree order")


_DIV_CHECK = r"""
#include "gather_emu.h"
#undef __shared__
#define __shared__ static
inline void __syncwarp(unsigned = 0xFFFFFFFFu) {}
#include "kernel.cu"
#include <cstdio>
#include <random>
// kernel.cu's tq_div_row (one element a call) against the host's IEEE division: random
// significands, exponents over the fast path's range and past it, divisors with all-ones or
// all-zero significands, the kernel's own pairs (|a| <= b, b near 1 .. 1e4), signed zeros.
// Prints "mismatches fast_taken".
int main() {
  std::mt19937_64 g(12345);
  long bad = 0, fast = 0;
  auto f = [](u32 bits) { return bits_f32(bits); };
  for (long it = 0; it < 6000000; ++it) {
    const u32 r1 = static_cast<u32>(g()), r2 = static_cast<u32>(g()), kind = it % 6;
    u32 ea = 127 + static_cast<int>(r1 >> 24) % 130 - 65, eb = 127 + static_cast<int>(r2 >> 24) % 130 - 65;
    u32 ma = r1 & 0x7FFFFFu, mb = r2 & 0x7FFFFFu;
    if (kind == 1) mb = 0x7FFFFFu;
    if (kind == 2) mb = 0;
    if (kind == 3) ma = 0x7FFFFFu - (r2 & 7u);
    if (kind == 4) { eb = 127 + static_cast<int>(r2 >> 28) % 14; ea = eb - static_cast<int>(r1 >> 27) % 30; }
    if (kind == 5) { eb = 127 + static_cast<int>(r2 >> 28) % 14 - 27; ea = eb - static_cast<int>(r1 >> 27) % 30 + 1; }
    if (it % 1000 == 999) ea = ma = 0;  // +-0
    const float a = f(((r1 >> 23) & 1u) << 31 | ea << 23 | ma), b = f(eb << 23 | mb);
    const bool fb = tq_div_fast(b);
    const float aa = a < 0 ? -a : a;
    fast += fb && (aa == 0 || (aa >= f(0x21800000u) && aa <= f(0x5D800000u)));
    const float av[1] = {a};
    float q[1];
    tq_div_row<1>(q, av, b, 1.0f / b, fb);
    const float want = a / b, got = q[0];
    if (f32_bits(want) != f32_bits(got) && !(want != want && got != got)) {
      if (bad < 5) std::printf("a=%a b=%a want=%a got=%a\n", a, b, want, got);
      ++bad;
    }
  }
  std::printf("%ld %ld\n", bad, fast);
}
"""


def test_kernel_division_is_correctly_rounded(tmp_path):
    """kernel.cu's row-reciprocal division (tq_div_row) gives the correctly rounded quotient,
    signed zeros included, on 6 * 10^6 pairs, most of them on its fast path."""
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl
    out = run_emu_program(tmp_path, "div", _DIV_CHECK, pathlib.Path(cuda_impl.__file__).parent)
    bad, fast = map(int, out.split()[-2:])
    assert bad == 0, out
    assert fast > 6000000 * 0.6, out


_HADAMARD_CHECK = r"""
#include "gather_emu.h"
#undef __shared__
#define __shared__ static
inline void __syncwarp(unsigned = 0xFFFFFFFFu) {}
#include "kernel.cu"
#include <cstdio>
#include <random>
// kernel.cu's tq_hadamard_misses against the entry-by-entry rule, for every 16-byte load of
// the Sylvester Hadamard of every power-of-two d from 4 to 1024 times a random h: zero on the
// table, nonzero with any one of its four entries changed (the sign, a low bit, a zero's sign).
// Prints "wrong_accepts wrong_rejects loads".
int main() {
  std::mt19937 g(7);
  long accepts = 0, rejects = 0, loads = 0;
  for (u32 lg = 2; lg <= 10; ++lg) {
    const u32 d = 1u << lg;
    const u32 hb = (g() & 0x807FFFFFu) | (0x3Fu << 23) | ((lg & 1u) ? 0u : 0x80000000u);
    for (u32 kk = 0; kk < d * d; kk += 4) {
      u32 e[4];
      for (u32 c = 0; c < 4; ++c) {
        const u32 i = (kk + c) >> lg, j = (kk + c) & (d - 1u);
        e[c] = hb ^ ((tq_popc(i & j) & 1u) << 31);
      }
      ++loads;
      rejects += tq_hadamard_misses(uint4{e[0], e[1], e[2], e[3]}, kk, lg, hb) != 0u;
      for (u32 c = 0; c < 4; ++c)
        for (u32 flip : {0x80000000u, 1u, 0x00400000u}) {
          u32 w[4] = {e[0], e[1], e[2], e[3]};
          w[c] ^= flip;
          accepts += tq_hadamard_misses(uint4{w[0], w[1], w[2], w[3]}, kk, lg, hb) == 0u;
        }
    }
  }
  std::printf("%ld %ld %ld\n", accepts, rejects, loads);
}
"""


def test_kernel_hadamard_check_takes_one_parity_a_load(tmp_path):
    """kernel.cu's table check (tq_hadamard_misses: one parity for a 16-byte load's four
    entries) accepts every load of the scaled Sylvester Hadamard of D = 4 .. 1024 and rejects
    each of them with any one entry's sign or a bit of its significand changed."""
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl
    out = run_emu_program(tmp_path, "had", _HADAMARD_CHECK,
                          pathlib.Path(cuda_impl.__file__).parent)
    accepts, rejects, loads = map(int, out.split()[-3:])
    assert (accepts, rejects) == (0, 0), out
    assert loads == sum(4**k for k in range(1, 10)), out  # d * d / 4 for d = 4 .. 1024


@needs_nvrtc
def test_nvrtc_compiles_for_sm80_and_sm100():
    """A few variants on sm_80 (the software fp8 conversion) and sm_100; sm_90 compiles every
    one of all_kernel_names in test_conformance (test_nvrtc_compiles_every_variant)."""
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl as c
    names = c.all_kernel_names()
    # 3 input kinds x 2 slot types x (4 presets x 5 E, less E = 2, 4 for the two 3-bit ones,
    # and E = 8 at two CTA sizes), the table check, and the split kernels (3 input kinds x 2
    # slot types x 3 MSE presets x E = 2, 4).
    assert len(names) == len(set(names)) == 3 * 2 * (4 * 5 - 2 * 2 + 4) + 1 + 3 * 2 * 3 * 2
    few = [n for n in names if ", 4, int, 16, 512>" in n or ", 3, long long, 32, 256>" in n][:4]
    for arch in ("sm_80", "sm_100"):
        obj, _ = c.compile_kernel(arch, few)
        assert len(bytes(obj.code)) > 0


@needs_nvrtc
def test_nvrtc_specialized_builds_read_no_fixed_argument(tmp_path):
    """sm_90 kernels find their parameters at c[0x0][0x210] on: the 16 fixed arguments
    (FIXED_ARGS) follow tq_kernel's ten leading ones (seven addresses, the tokens, the log2 of
    the warps with rows, the flags' count) and tq_split_kernel's seven (six addresses, the
    tokens); a build specialized for a call reads none of them, the generic build does; a
    build given other than 16 values is refused."""
    from kvwrite.kernels import launch
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl as c
    from sass import assert_source_fixed_args_compiled_in, cuobjdump_or_skip
    cuobjdump_or_skip()
    bf16 = launch.KIND[torch.bfloat16]
    builds = []
    for name, d in (("turboquant_k8v4", 128), ("turboquant_4bit_nc", 128),
                    ("turboquant_3bit_nc", 64)):
        preset, (key, value, kv_cache, _, pit, mids) = make_case(name, torch.bfloat16,
                                                                 torch.int64, d)
        fixed = c.fixed_args(key, value, kv_cache, pit, mids)  # k8v4: no tables
        kb, vb = int(preset.key_bits), int(preset.value_bits)
        builds.append((c.kernel_name(bf16, kb, vb, torch.int64, 8, c.cta_options(kb, 8)[0]),
                       fixed, 10))
        builds.append((c.kernel_name(bf16, kb, vb, torch.int32, 16, 512), fixed, 10))
        if preset.mse:
            builds.append((c.split_kernel_name(bf16, kb, vb, torch.int64, d // 32), fixed, 7))
    for kernel, fixed, leading in builds:
        assert_source_fixed_args_compiled_in(c.SOURCE, kernel, fixed, leading, tmp_path)
    with pytest.raises(RuntimeError, match="16 values"):
        c.compile_kernel("sm_90", builds[0][0], fixed=(1, 2, 3))


@needs_nvrtc
def test_nvrtc_pdl_builds_wait_before_any_memory_access(tmp_path):
    """sm_90, every bfloat16 variant (the table check, tq_kernel's, the split kernel's): the PDL
    build lets the next kernel start (PREEXIT) and waits for the one before (ACQBULK) before its
    first global access; the plain build does neither."""
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl as c
    from sass import assert_pdl_builds_wait_first, cuobjdump_or_skip
    cuobjdump_or_skip()
    names = [n for n in c.all_kernel_names() if n.startswith("tq_check") or "<1, " in n]
    assert len(names) == 1 + (157 - 1) // 3
    assert_pdl_builds_wait_first(c.SOURCE, names, tmp_path)


def test_lanes_and_grid():
    """E and the lanes a row for each head size (E = 16 where P allows, P / E <= 32), and the
    grid: the rows' CTAs, at most the resident ones."""
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl as c
    assert [c.lanes(d) for d in (2, 8, 10, 16, 24, 128, 256, 512, 1024)] == [
        (2, 1), (8, 1), (16, 1), (16, 1), (16, 2), (16, 8), (16, 16), (16, 32), (32, 32)]
    # Small calls: small_lane_elems a lane, at least P / 32 and min_elems (8 for 3-bit).
    t = c.CudaTuning(small_lane_elems=4)
    assert c.lanes(128, t, rows=t.small_rows) == (4, 32)
    assert c.lanes(128, t, rows=t.small_rows + 1) == (16, 8)
    assert c.lanes(128, t, rows=8, least=8) == (8, 16)
    assert c.lanes(1024, t, rows=8) == (32, 32)
    assert c.lanes(128, rows=c.TUNING.small_rows) == (c.TUNING.small_lane_elems,
                                                      128 // c.TUNING.small_lane_elems)
    assert c.min_elems(make_preset("turboquant_k3v4_nc", 16)) == 8
    assert c.min_elems(make_preset("turboquant_4bit_nc", 16)) == 2
    # 64 rows a CTA of 512 threads at E = 16, 32 at E = 8 (the small calls'), 16 at E = 4; 8 a
    # CTA of 128 threads at E = 8 (k8v4's small calls)
    assert c.grid(8, 128, 132, 512) == 1 and c.grid(t.small_rows + 1, 128, 1000, 512) == 65
    assert c.grid(64 * 5 + 1, 128, 132, 512, c.CudaTuning(small_rows=0)) == 6
    assert c.grid(32 * 5 + 1, 128, 132, 512) == 6 and c.grid(16 * 5 + 1, 128, 132, 512, t) == 6
    assert c.grid(8 * 5 + 1, 128, 132, 128) == 6 and c.grid(8 * 200, 128, 132, 128) == 132
    assert c.grid(16384 * 8, 128, 132, 512) == 132
    assert c.grid(16384 * 8, 128, 132, 512, c.CudaTuning(waves=2)) == 264
    # CTA sizes: k8v4 at E = 8 128 threads while its CTAs are at most the SMs, else 512
    assert c.cta_options(8, 8) == (128, 512) and c.cta_options(4, 8) == (256, 512)
    assert c.cta_options(8, 16) == (512,) and c.cta_options(8, 32) == (256,)
    assert c.cta_threads(8, 8, 16, 132 * 8, 132) == 128
    assert c.cta_threads(8, 8, 16, 132 * 8 + 1, 132) == 512
    assert c.cta_threads(8, 8, 32, 132 * 4, 132) == 128  # D = 256: 4 rows a CTA
    assert c.cta_threads(8, 8, 32, 132 * 4 + 1, 132) == 512
    # the MSE presets at E = 8: 256 where that makes more CTAs than 512, at most the SMs
    assert c.cta_threads(4, 8, 16, 32, 132) == 512 and c.cta_threads(3, 8, 16, 33, 132) == 256
    assert c.cta_threads(4, 8, 16, 16 * 132, 132) == 256
    assert c.cta_threads(4, 8, 16, 16 * 132 + 1, 132) == 512
    assert c.cta_threads(8, 16, 8, 8, 132) == 512 and c.cta_threads(8, 32, 32, 8, 132) == 256
    assert sum(n.startswith("tq_kernel<") and n.endswith(", 8, 128>")
               for n in c.all_kernel_names()) == 6
    # warps with rows: every one but in the MSE presets' small calls (E = 8): at least
    # mse_row_warps, as many as keep the CTAs at most the SMs, a power of two
    assert c.row_warps(8, 8, 16, 8, 128, 132) == 4 and c.row_warps(4, 16, 8, 8, 512, 132) == 16
    assert c.row_warps(4, 8, 16, 8, 512, 132) == 4 == c.TUNING.mse_row_warps
    assert c.row_warps(3, 8, 16, 2 * 4 * 132, 512, 132) == 4
    assert c.row_warps(3, 8, 16, 2 * 4 * 132 + 1, 512, 132) == 8
    with pytest.raises(ValueError, match="power of two"):
        c.launch_args(*[None] * 7, 3, None)
    # the build with the fixed arguments compiled in: k8v4's calls of at most specialize_rows
    # rows, every MSE preset's call
    assert c.specialized(c.TUNING.specialize_rows, False) is c.TUNING.specialize
    assert not c.specialized(c.TUNING.specialize_rows + 1, False)
    assert c.specialized(c.TUNING.specialize_rows + 1, True) is c.TUNING.specialize  # MSE: all
    assert not c.specialized(1, False, c.CudaTuning(specialize=False))
    assert not c.specialized(1, True, c.CudaTuning(specialize=False))
    assert c.row_warps(4, 8, 16, 4096, 256, 64) == 8
    assert c.row_warps(4, 8, 16, 4096, 512, 64) == 16
    # the table check's kernel: the MSE presets' calls of at most check_rows rows, D a power of
    # two, four entries a thread
    assert c.check_ctas(4, 128, c.TUNING.check_rows) == 16 == c.check_ctas(3, 128, 8)
    assert c.check_ctas(4, 128, c.TUNING.check_rows + 1) == 0 == c.check_ctas(8, 128, 8)
    assert c.check_ctas(4, 96, 8) == 0 and c.check_ctas(4, 2, 8) == 1
    assert c.check_ctas(4, 1024, 8) == 1024 and c.check_ctas(4, 64, 8, threads=128) == 8
    assert c.grid(128, 128, 132, 512, warps=4) == 16 and c.grid(128, 128, 132, 512) == 4
    # the split kernel: the MSE presets' calls of at most split_warps warps (rows x D / 8),
    # P = 64, 128; one warp a row and 8 outputs, 4 warps a CTA
    n = c.TUNING.split_warps
    assert c.split_elems(4, 128, n // 16) == 4 and c.split_elems(3, 64, n // 8) == 2
    assert c.split_elems(4, 128, n // 16 + 1) == 0 == c.split_elems(3, 64, n // 8 + 1)
    assert c.split_elems(3, 256, 8) == 0 and c.split_elems(4, 100, 8) == 4
    assert c.split_elems(8, 128, 8) == 0
    assert c.split_elems(4, 32, 8) == 0 == c.split_elems(4, 512, 8)
    assert c.split_grid(8, 128) == 32 and c.split_grid(1, 100) == 4 and c.split_grid(3, 40) == 4


_TRITON_PTX_SCRIPT = TRITON_PTX_PRELUDE + r"""
from kvwrite.ops.reshape_and_cache_turboquant import triton_impl as tq
out = {}
for kb, vb in ((8, 4), (4, 4), (3, 4), (3, 3)):
    for in_ty in ("*fp16", "*i16", "*fp32"):
        types = {"key_ptr": in_ty, "value_ptr": in_ty, "cache_ptr": "*u8",
                 "slot_mapping_ptr": "*i32", "pit_ptr": "*fp32" if kb != 8 else "*u8",
                 "mid_ptr": "*fp32" if kb != 8 else "*u8"}
        for n in ("K_TOK", "K_HEAD", "V_TOK", "V_HEAD", "C_B", "C_S", "C_H", "P_0", "P_1",
                  "MID_S", "NUM_SLOTS", "H"):
            types[n] = "i32"
        consts = dict(BLOCK_SIZE=16, D=128, BLOCK_D=128, BLOCK_J=32, KB=kb, VB=vb,
                      KPS=128 if kb == 8 else 16 * kb + 2, BF16_BITS=in_ty == "*i16")
        text = ptx(tq._tq_kernel, types, consts)
        out[f"{kb}{vb}{in_ty}"] = [text.count("fma.rn.f32"), text.count("div.rn.f32"),
                                   text.count("sqrt.rn.f32"), text.count("add.rm.f32")]
    for in_ty in ("*fp16", "*i16", "*fp32"):  # the rows kernel
        types = {"key_ptr": in_ty, "value_ptr": in_ty, "cache_ptr": "*u8",
                 "slot_mapping_ptr": "*i64", "pit_ptr": "*fp32", "mid_ptr": "*fp32",
                 "flags_ptr": "*i32"}
        for n in ("K_TOK", "K_HEAD", "V_TOK", "V_HEAD", "C_B", "C_S", "C_H", "P_0", "P_1",
                  "MID_S", "NUM_SLOTS", "H", "ROWS"):
            types[n] = "i32"
        for words in (False, True) if kb == 8 else (False,):
            consts = dict(BLOCK_SIZE=16, D=128, BLOCK_D=128, BLOCK_R=8, BLOCK_J=8, NUM_FLAGS=8,
                          KB=kb, VB=vb, KPS=128 if kb == 8 else 16 * kb + 2,
                          BF16_BITS=in_ty == "*i16", STRIDE=kb != 8, BUTTERFLY=kb != 8,
                          COMPILED=True, WORDS=words)
            text = ptx(tq._tq_rows_kernel, types, consts)
            out[f"rows{kb}{vb}{in_ty}{'/words' if words else ''}"] = [
                text.count("fma.rn.f32"), text.count("div.rn.f32"), text.count("sqrt.rn.f32"),
                text.count("add.rm.f32"), text.count("st.global.b8"), text.count("st.global.b32")]
print(json.dumps(out))
"""


def test_triton_kernel_compiles_for_sm90_without_fma():
    """Every preset and input kind compiles for the GPU (outside the interpreter), on both
    kernels: no fused multiply-add, true divisions, the correctly rounded root where the preset
    needs it."""
    out = run_triton_script(_TRITON_PTX_SCRIPT)
    assert len(out) == 27
    for name, (fma, div, sqrt, add_rm, *stores) in out.items():
        if name.endswith("/words"):  # k8v4's slots as 4-byte words: no byte store is left
            assert stores[0] == 0 and stores[1] > 0, (name, out)
        k8v4 = name.startswith(("8", "rows8"))
        # The rows kernel's value codes take two explicit FMAs an element (tl.fma: the
        # quotient's corrections) and two sums rounded toward -inf (the code); nothing else
        # contracts.
        rows = name.startswith("rows")
        assert (fma > 0) == rows and (add_rm > 0) == rows and div > 0, (name, out)
        assert (sqrt > 0) != k8v4, (name, out)  # one a row (BLOCK_R rows: replicated)


def test_unsupported_head_sizes():
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl, triton_impl
    p = make_preset("turboquant_4bit_nc", 1024)
    key = torch.empty(1, 1, 1024)
    assert cuda_impl.unsupported(key, None, p) is None
    assert "1024 > 512" in triton_impl.unsupported(key, None, p)
    assert "2048 > 1024" in cuda_impl.unsupported(torch.empty(1, 1, 2048), None, p)


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------
def _gpu_impl(name):
    """An implementation on the GPU by name: "cuda" and "triton" as the launchers choose;
    "cuda-wide" the CUDA kernel with lane_elems a lane and its CTAs' own table check at every
    call size (the large-call path; the small tests' calls otherwise take tq_split_kernel, or
    small_lane_elems and the table check's kernel), "cuda-nosplit" tq_kernel at every call size
    as the launcher configures it (the small calls' lanes and table check), "cuda-generic" the
    launcher's choices with generic builds (no fixed argument compiled in), "triton-rows" / "triton-row1"
    every call on the Triton rows kernel, BLOCK_R its widest / 1 (MSE: one program an SM,
    striding), "triton-program-a-row" every call on _tq_kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl, triton_impl
    base = name.split("-")[0]
    impl = {"cuda": cuda_impl, "triton": triton_impl}[base]
    reason = impl.available(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    if name == "cuda-wide":
        return _Tuned(impl, dataclasses.replace(impl.TUNING, small_rows=0, check_rows=0,
                                                split_warps=0))
    if name == "cuda-nosplit":
        return _Tuned(impl, dataclasses.replace(impl.TUNING, split_warps=0))
    if name == "cuda-generic":
        return _Tuned(impl, dataclasses.replace(impl.TUNING, specialize=False))
    if name.startswith("triton-row"):  # "-rows": BLOCK_R as wide as rows_elems allows, "-row1": 1
        wide = name == "triton-rows"
        return _Tuned(impl, dataclasses.replace(
            impl.TUNING, k8v4_rows_min=0, rows_programs=1 if wide else 1 << 30, mse_rows_min=0,
            mse_rows_elems=impl.TUNING.mse_rows_elems if wide else 1, mse_small_rows=0,
            mse_programs_per_sm=1))
    if name == "triton-program-a-row":
        return _Tuned(impl, dataclasses.replace(impl.TUNING, k8v4_rows_min=1 << 62,
                                                mse_rows_min=1 << 62))
    return impl



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda v: str(v)[6:])
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_k8v4_staged_stores(dtype, d):
    """A k8v4 call of more than TQ_STAGE_PASSES passes a warp on this GPU (a pass: at most two
    512-thread CTAs an SM, 512 / D rows a warp), which stores through shared memory: the whole
    allocation as the oracle's."""
    h = 8
    sm = torch.cuda.get_device_properties(0).multi_processor_count if \
        torch.cuda.is_available() else 0
    t = (_stage_passes() + 1) * sm * 2 * 16 * (512 // d) // h + 7
    _check(_gpu_impl("cuda"), "turboquant_k8v4", dtype, torch.int64, d, t=t, h=h,
           nb=-(-t // 16) + 2, bs=16, device="cuda", seed=d)


@pytest.mark.gpu
@pytest.mark.parametrize("impl_name", ["cuda", "cuda-generic"])
def test_gpu_specialized_builds_are_the_default(monkeypatch, record_builds, impl_name):
    """tq_kernel and tq_split_kernel are built for each call's fixed arguments in the MSE
    presets' calls and k8v4's of at most specialize_rows rows (k8v4's larger ones and the table
    check: generic), one build a signature and its PDL twin; "cuda-generic" builds none."""
    impl = _gpu_impl(impl_name)
    from kvwrite.kernels import launch
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl
    for cache in ("LAUNCHES", "SPLITS", "CHECKS"):
        monkeypatch.setattr(cuda_impl, cache, launch.LaunchCache())
    seen = record_builds(cuda_impl.SOURCE)
    large = cuda_impl.TUNING.specialize_rows // 4 + 1  # tokens of h = 4
    for name, t in (("turboquant_k8v4", 3), ("turboquant_4bit_nc", 3),
                    ("turboquant_4bit_nc", 300), ("turboquant_3bit_nc", 300),
                    ("turboquant_k8v4", large), ("turboquant_4bit_nc", large)):
        _check(impl, name, torch.bfloat16, torch.int64, 128, t=t, h=4, nb=-(-t // 16) + 2,
               bs=16, device="cuda", seed=t, pit_kind="hadamard")
    assert len(cuda_impl.SPLITS) == 1 and len(cuda_impl.LAUNCHES) == 5 and cuda_impl.CHECKS
    twins = 1 if next(iter(cuda_impl.SPLITS.values())).pdl_kernel is None else 2
    special = [sig[-1] for sig in (*cuda_impl.LAUNCHES, *cuda_impl.SPLITS)]
    assert special == [impl_name == "cuda"] * 3 + [False] + [impl_name == "cuda"] * 2
    built = [*cuda_impl.LAUNCHES.values(), *cuda_impl.SPLITS.values()]
    expected = [lau.fixed if sp else None for lau, sp in zip(built, special, strict=True)
                for _ in range(twins)] + [None] * twins * len(cuda_impl.CHECKS)
    assert sorted(seen, key=str) == sorted(expected, key=str)


@pytest.mark.gpu
def test_gpu_cta_sizes():
    """Each call's CTA size is cta_threads' and the loaded variant's (its max_threads_per_block,
    __launch_bounds__'s CTA): small calls' 128 (k8v4) or 256 threads (the MSE presets, whose
    tables the check's kernel reads) while those CTAs fit one an SM, 512 past that and at E = 16
    (the MSE presets' CTAs checking the table themselves); every call spans several CTAs and
    matches the oracle, the MSE presets with vLLM's Hadamard table."""
    impl = _gpu_impl("cuda-nosplit")
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    h = 4  # D = 128, E = 8: 8 rows a 128-thread CTA
    many = (sm + 1) * 8 // h + 1  # more 128-thread CTAs than SMs, still a small call
    mse_many = (sm * 16) // h + 1  # more 256-thread CTAs than SMs, still a small call
    assert many * h <= cuda_impl.TUNING.small_rows and mse_many * h <= cuda_impl.TUNING.check_rows
    cuda_impl.LAUNCHES.clear()
    cuda_impl.CHECKS.clear()
    for name, t in (("turboquant_k8v4", 40), ("turboquant_4bit_nc", 40),
                    ("turboquant_4bit_nc", mse_many), ("turboquant_k8v4", many),
                    ("turboquant_k8v4", 1100), ("turboquant_4bit_nc", 1100)):
        _check(impl, name, torch.bfloat16, torch.int64, 128, t=t, h=h, nb=-(-t // 16) + 2,
               bs=16, device="cuda", seed=t, pit_kind="hadamard")
    sizes = sorted((sig[1], sig[4], sig[5]) for sig in cuda_impl.LAUNCHES)
    assert sizes == [(4, 8, 256), (4, 8, 512), (4, 16, 512), (8, 8, 128), (8, 8, 512),
                     (8, 16, 512)], sizes
    assert len(cuda_impl.CHECKS) == 1
    for sig, lau in cuda_impl.LAUNCHES.items():
        assert lau.kernel.attributes.max_threads_per_block == sig[5]


GPU_PARAMS = [(p, dt, sd, d) for p in PRESETS for dt in (torch.float16, torch.bfloat16, torch.float32)
              for sd in (torch.int32, torch.int64) for d in (16, 64, 128, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_PATHS)
@pytest.mark.parametrize("preset_name, dtype, slot_dtype, d", GPU_PARAMS,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_gpu_matches_oracle(impl, preset_name, dtype, slot_dtype, d):
    _check(_gpu_impl(impl), preset_name, dtype, slot_dtype, d, t=24, h=4, nb=8, bs=16,
           device="cuda", seed=d, pit_kind="hadamard" if d % 2 == 0 and d != 64 else "random")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_PATHS)
@pytest.mark.parametrize("preset_name", PRESETS)
@pytest.mark.parametrize("d, pit_kind", [(8, "identity"), (40, "random"), (512, "hadamard"),
                                         (10, "random")])
def test_gpu_shapes_and_ties(impl, preset_name, d, pit_kind):
    if d % 8 and _BITS[preset_name][0] == 3 or d % 8 and _BITS[preset_name][1] == 3:
        pytest.skip("3-bit fields need D % 8 == 0")
    _check(_gpu_impl(impl), preset_name, torch.bfloat16, torch.int32, d, t=9, h=3, nb=3, bs=5,
           device="cuda", seed=d + 1, pit_kind=pit_kind, vllm_alloc=d % 3 == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [8, 10, 16, 64])
@pytest.mark.parametrize("block_r", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("special", [True, False], ids=["special", "plain"])
@pytest.mark.parametrize("preset_name, warps", [("turboquant_k8v4", 1), ("turboquant_4bit_nc", 1),
                                                ("turboquant_4bit_nc", 4)])
def test_gpu_triton_rows_kernel_block_rows(d, block_r, special, preset_name, warps):
    """The rows kernel at each BLOCK_R: the fp16 scale and minimum stores of BLOCK_R rows
    (Triton 3.6 wrote wrong bytes at D = 8, BLOCK_R = 16 and D = 10, BLOCK_R = 8 and 16 with two
    [BLOCK_R] stores a value in programs of one warp); MSE rows at one program an SM."""
    mod = _gpu_impl("triton")
    block_d = 1 << (d - 1).bit_length()
    tuning = dataclasses.replace(mod.TUNING, k8v4_rows_min=0, rows_elems=block_r * block_d,
                                 rows_programs=0, rows_warps=warps, mse_rows_min=0,
                                 mse_rows_elems=block_r * block_d, mse_small_rows=0,
                                 mse_warps=warps,
                                 mse_programs_per_sm=1)
    _check(_Tuned(mod, tuning), preset_name, torch.bfloat16, torch.int32, d, t=9, h=3,
           nb=3, bs=5, device="cuda", seed=d + 1, vllm_alloc=d % 3 == 0, special=special,
           pit_kind="hadamard" if d in (8, 16, 64) else "random")


@pytest.mark.gpu
def test_gpu_cuda_long_rows():
    """D = 1024 (the CUDA kernel's largest; Triton refuses it)."""
    _check(_gpu_impl("cuda"), "turboquant_4bit_nc", torch.float16, torch.int64, 1024, h=2,
           device="cuda", pit_kind="hadamard")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "cuda-nosplit", "triton"])
@pytest.mark.parametrize("preset_name", PRESETS[1:])
@pytest.mark.parametrize("case", range(len(SPLIT_TREE_CASES)))
def test_gpu_sums_by_the_tree(impl, preset_name, case):
    _check_inputs(_gpu_impl(impl), *tree_order_case(preset_name, "cuda", **SPLIT_TREE_CASES[case]),
                  "tree order")


class _Tuned:
    """An implementation module's run with a tuning (the CUDA kernel's lanes a row)."""

    def __init__(self, impl, tuning):
        self.impl, self.tuning = impl, tuning

    def unsupported(self, key, kv_cache, preset):
        return self.impl.unsupported(key, kv_cache, preset)

    def run(self, *args):
        self.impl.run(*args, tuning=self.tuning)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("preset_name, d, lane_elems", HADAMARD_PARAMS)
def test_gpu_hadamard_path(impl, preset_name, d, lane_elems):
    """The emulated Hadamard-path cases on the GPU (the CUDA kernel with its lanes a row set by
    lane_elems; Triton once per case)."""
    mod = _gpu_impl(impl)
    if impl == "cuda":
        mod = _Tuned(mod, mod.CudaTuning(lane_elems=lane_elems, split_warps=0))
    elif lane_elems != 16:
        pytest.skip("lane_elems is the CUDA kernel's")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        preset, inputs = table_case(preset_name, d, dtype=dtype, seed=d, device="cuda")
        _check_inputs(mod, preset, inputs, f"{preset_name} D={d} {dtype} E<={lane_elems}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "cuda-wide", "cuda-nosplit", "triton"])
@pytest.mark.parametrize("preset_name", MSE_PRESETS)
@pytest.mark.parametrize("pit_kind, mids_kind", TABLE_KINDS)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_table_variants(impl, preset_name, pit_kind, mids_kind, d):
    preset, inputs = table_case(preset_name, d, pit_kind, mids_kind, dtype=torch.bfloat16,
                                t=40, h=3, seed=3, device="cuda")
    _check_inputs(_gpu_impl(impl), preset, inputs, f"{preset_name} {pit_kind} {mids_kind}")


def _reference_write(inp):
    """The cache's allocation after the torch reference's write of ``inp`` (a copy)."""
    import kvwrite
    from kvwrite.testing.compare import copy_allocations
    want = copy_allocations((inp.kv_cache,))[0]
    args = list(inp.args())
    args[2] = want
    kvwrite.reshape_and_cache_turboquant(*args, implementation="torch")
    return want


def _tq_case(preset_name, t, pit_kind, **kw):
    from kvwrite.testing.turboquant import TqCase
    return TqCase(kv_cache_dtype=preset_name, num_tokens=t, num_heads=8, head_size=128,
                  dtype=torch.bfloat16, block_size=16, num_blocks=t // 16 + 3,
                  special_values=True, padding_slots=1 if t > 2 else 0,
                  out_of_range_slots=1 if t > 4 else 0, own_tables=pit_kind == "random", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("preset_name, pit_kind", [(p, k) for p in PRESETS
                                                   for k in ("hadamard", "random")
                                                   if p != "turboquant_k8v4" or k == "hadamard"])
@pytest.mark.parametrize("t", [1, 7, 300, 5000])
def test_gpu_rotation_paths_against_the_reference(impl, preset_name, pit_kind, t):
    """turboquant_tables' Hadamard (the butterflies) and a random orthogonal table (the products'
    trees) against reference.py, whole allocations, H = 8, D = 128, bf16 (as the benchmark)."""
    import kvwrite
    from kvwrite.testing.turboquant import assert_tq_caches_equal, make_tq_inputs
    _gpu_impl(impl)
    case = _tq_case(preset_name, t, pit_kind)
    inp = make_tq_inputs(case, "cuda", seed=t)
    want = _reference_write(inp)
    kvwrite.reshape_and_cache_turboquant(*inp.args(), implementation=impl)
    torch.cuda.synchronize()
    assert_tq_caches_equal(inp.kv_cache, want, case.slot)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("preset_name", MSE_PRESETS)
@pytest.mark.parametrize("t", [4, 300])
def test_gpu_graph_replay_switches_rotation_paths(impl, preset_name, t):
    """Captured with vLLM's tables, replayed after new rows, cache bytes and tables were copied
    in: a random table (the generic path), the Hadamard again, one a ulp off with midpoints out of
    order, the negated Hadamard; each replay writes the reference's bytes (T = 4: the CUDA
    split kernel, 300: the table check and tq_kernel)."""
    import kvwrite
    from kvwrite.testing.compare import storage_bytes
    from kvwrite.testing.turboquant import assert_tq_caches_equal, make_tq_inputs
    _gpu_impl(impl)
    case = _tq_case(preset_name, t, "hadamard")
    first = make_tq_inputs(case, "cuda", seed=1)
    kvwrite.reshape_and_cache_turboquant(*first.args(), implementation=impl)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvwrite.reshape_and_cache_turboquant(*first.args(), implementation=impl)
    for i, (pit_kind, mids_kind) in enumerate([("random", "tables"), ("tables", "tables"),
                                               ("ulp", "unsorted"), ("negated", "tables")]):
        new = make_tq_inputs(case, "cuda", seed=10 + i)
        for dst, src in ((first.key, new.key), (first.value, new.value),
                         (first.kv_cache, new.kv_cache), (first.slot_mapping, new.slot_mapping)):
            storage_bytes(dst).copy_(storage_bytes(src))
        pit, mids = table_variant(128, preset_name, pit_kind, mids_kind, seed=i)
        first.PiT.copy_(pit)
        first.midpoints.copy_(mids)
        want = _reference_write(first)
        graph.replay()
        torch.cuda.synchronize()
        assert_tq_caches_equal(first.kv_cache, want, case.slot, f"replay {pit_kind} {mids_kind}")


@pytest.mark.parametrize("pit_kind, butterflies", [
    ("tables", True), ("negated", True), ("strided", True), ("offset", True), ("zero", True),
    ("ulp", False), ("sign", False), ("corner", False), ("random", False)])
def test_triton_table_kernel_flags_on_cpu(pit_kind, butterflies):
    """_tq_table_kernel's flags (the rows kernel takes the butterflies only where every one is
    0): the Hadamard read any way and ±0 with its signs pass, one entry off anywhere (a ulp, a
    sign, the last corner) fails its program's flag and only that one."""
    tq = _triton()
    d = 32
    pit, _ = table_variant(d, "turboquant_4bit_nc", pit_kind, "tables", seed=3)
    rows = 8
    flags = torch.full((d // rows,), -1, dtype=torch.int32)
    tq._tq_table_kernel[(d // rows,)](pit, *pit.stride(), flags, D=d, CHECK_ROWS=rows, PDL=False,
                                      PDL_TRIGGER=False)
    if butterflies:
        assert flags.tolist() == [0] * (d // rows)
    elif pit_kind == "random":
        assert flags.tolist() == [1] * (d // rows)
    else:
        ref = table_variant(d, "turboquant_4bit_nc", "tables", "tables", seed=3)[0]
        bad_rows = {int(i) // rows for i in (pit.view(torch.int32) != ref.view(torch.int32))
                    .nonzero()[:, 0]}
        assert len(bad_rows) == 1
        assert flags.tolist() == [int(p in bad_rows) for p in range(d // rows)]
