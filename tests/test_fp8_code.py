"""fp8 codes in Triton (kvwrite.kernels.triton_fp8's ``fp8_code`` and ``fp8_bytes``) and the
kernels that write them:

- the integer form (``NATIVE`` false: GPUs below sm_89, where Triton has no e4m3 type, and its
  interpreter) against PyTorch's conversion of the value clamped to ±MAX (correctly rounded, NaN
  0x7F with its sign), under the interpreter: every fp8 value, every midpoint between two
  neighbours and the float32 values beside it, the subnormals, ±0, ±MAX and past it, ±inf, NaN
  and random float32 patterns; on the GPU both forms (``NATIVE`` as the device has it);
- every Triton kernel that writes fp8 codes, compiled without a GPU as its launcher launches it:
  for sm_80 with no float8 type in its PTX, for sm_90 with the float8 conversion
  (``cvt.rn.satfinite``, the instructions these kernels have had on the H200);
- each of those launchers passes ``triton_support.native_fp8`` of the call's device as
  ``NATIVE``.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from host import run_triton_script
from kvwrite.kernels import triton_fp8, triton_support
from kvwrite.layouts import Layout
from kvwrite.testing import conformance
from kvwrite.testing.cases import Case
from kvwrite.testing.indexer import IndexerCase
from kvwrite.testing.legacy import LegacyCase
from kvwrite.testing.mla import MlaCase
from kvwrite.testing.per_token_head import FP8 as PTH_FP8
from kvwrite.testing.per_token_head import PthCase
from kvwrite.testing.qk_norm import QkNormCase
from kvwrite.testing.rope import RopeCase

HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(triton_fp8.triton is None, reason="triton is not installed")
FORMATS = {triton_fp8.E4M3: torch.float8_e4m3fn, triton_fp8.E5M2: torch.float8_e5m2}
FMAX = {triton_fp8.E4M3: 448.0, triton_fp8.E5M2: 57344.0}

if triton_fp8.triton is not None:
    tl, triton = triton_fp8.tl, triton_fp8.triton

    @triton.jit
    def _code_kernel(q_ptr, code_ptr, byte_ptr, n, FMT: tl.constexpr, NATIVE: tl.constexpr,
                     BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        q = tl.load(q_ptr + i, mask=ok)
        tl.store(code_ptr + i, triton_fp8.fp8_code(q, FMT, NATIVE), mask=ok)
        tl.store(byte_ptr + i, triton_fp8.fp8_bytes(q, FMT, NATIVE), mask=ok)


def _edges(fp8: torch.dtype) -> torch.Tensor:
    """float32 inputs around every code of ``fp8``: each non-negative value, the midpoint between
    it and the next (the tie) and the float32 values on either side of that midpoint (after MAX:
    the midpoint to the value one step past it), values past MAX (saturating), +inf, NaN, +0,
    tiny float32 values (the smallest subnormal, the smallest normal, 2^-40); all negated too."""
    vals = torch.arange(128, dtype=torch.int32).to(torch.uint8).view(fp8).double()
    vals = vals[~vals.isnan()]  # e4m3fn's 0x7F; e5m2's infinities and NaNs
    vals = vals[vals.isfinite()]
    top = vals[-1].item()
    step = top - vals[-2].item()
    nxt = torch.cat([vals[1:], torch.tensor([top + step], dtype=torch.float64)])
    mid = ((vals + nxt) / 2).float()
    up = (mid.view(torch.int32) + 1).view(torch.float32)
    down = (mid.view(torch.int32) - 1).view(torch.float32)
    extra = torch.tensor([float("inf"), float("nan"), 0.0, 1e-45, 2.0**-126, 2.0**-40,
                          3.4028235e38, top * 4, top + step / 4])
    x = torch.cat([vals.float(), mid, up, down, extra])
    return torch.cat([x, -x])


def _random_patterns() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(-(2**31), 2**31, (1 << 16,), generator=g, dtype=torch.int64)
    near = torch.randn(1 << 16, generator=g) * torch.exp2(
        torch.randint(-24, 18, (1 << 16,), generator=g).float())
    return torch.cat([bits.to(torch.int32).view(torch.float32), near])


def _expected(q: torch.Tensor, fmt: int) -> torch.Tensor:
    """PyTorch's code of each value clamped to ±MAX (clamping first: some PyTorch versions cast
    overflow to NaN)."""
    return q.clamp(-FMAX[fmt], FMAX[fmt]).to(FORMATS[fmt]).view(torch.uint8)


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN bit tricks
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(
        HAS_CUDA or triton_support.available(torch.device("cpu"), triton_fp8.triton,
                                              lambda: _code_kernel) is not None,
        reason="the interpreter check runs where there is no GPU")),
    pytest.param("cuda", marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("fmt", list(FORMATS), ids=["e4m3", "e5m2"])
def test_fp8_codes_are_pytorchs(fmt, device):
    """fp8_code (NaN -> 0x7F with its sign, as PyTorch) and fp8_bytes (the same bytes; NATIVE
    leaves a NaN's code to the conversion: any NaN) against PyTorch's correctly rounded
    conversion, in the form the device takes (triton_support.native_fp8)."""
    q = torch.cat([_edges(FORMATS[fmt]), _random_patterns()])
    native = triton_support.native_fp8(torch.device(device))
    code = torch.empty(q.numel(), dtype=torch.int32, device=device)
    byte = torch.empty(q.numel(), dtype=torch.uint8, device=device)
    block = 1 << 14
    _code_kernel[(triton.cdiv(q.numel(), block),)](q.to(device), code, byte, q.numel(), FMT=fmt,
                                                   NATIVE=native, BLOCK=block)
    want = _expected(q, fmt)
    for name, got, nan_any in (("fp8_code", code.cpu(), False), ("fp8_bytes", byte.cpu(), native)):
        bad = got.to(torch.int32) != want.to(torch.int32)
        if nan_any:
            bad &= ~(q.isnan() & (got.to(torch.uint8).view(FORMATS[fmt]).float().isnan()))
        idx = bad.nonzero().flatten()[:5]
        assert idx.numel() == 0, (f"{name}: {int(bad.sum())} codes differ, e.g. q="
                                  f"{q[idx].tolist()}: got {got[idx].tolist()}, "
                                  f"expected {want[idx].tolist()}")


# --- the kernels that write fp8 codes ------------------------------------------------------------

# One call of each op whose Triton kernels write fp8 codes: (op, case, the fp8 formats it writes,
# the kernels it launches as (module, name)). e4m3 and e5m2, a float8 cache (passed to the kernel
# as its uint8 view: triton_fp8.code_view) and uint8 ones, the fused QK-norm op's fp8 query, both
# MLA kernels' fp8 paths, the per-token-head kernel's fast and general paths (a call in the large
# calls' tiling). The QK-norm op's whole-row kernel takes calls of 17 tokens and more
# (RowsTuning.min_tokens).
_QK = "kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash.triton_impl"
_KV = [("kvwrite.kernels.triton_kv", "kv_write_kernel")]
WRITES = {
    "flash-e4m3-float8": ("reshape_and_cache_flash",
                          Case(kv_cache_dtype="fp8", fp8_storage="float8", layout=Layout.HND),
                          {"e4m3"}, _KV),
    "flash-e5m2": ("reshape_and_cache_flash",
                   Case(kv_cache_dtype="fp8_e5m2", dtype=torch.float32, per_head_scale=True),
                   {"e5m2"}, _KV),
    "legacy-e4m3": ("reshape_and_cache", LegacyCase(kv_cache_dtype="fp8"), {"e4m3"}, _KV),
    "rope-e4m3": ("fused_rope_and_reshape_cache_flash",
                  RopeCase(kv_cache_dtype="fp8", dtype=torch.float16), {"e4m3"},
                  [("kvwrite.ops.fused_rope_and_reshape_cache_flash.triton_impl",
                    "_fused_kernel")]),
    "qk-norm-e4m3-query-e5m2": ("fused_qk_norm_rope_and_reshape_cache_flash",
                                QkNormCase(kv_cache_dtype="fp8", query_out="fp8_e5m2"),
                                {"e4m3", "e5m2"}, [(_QK, "_qk_norm_rope_cache_kernel")]),
    "qk-norm-rows-e5m2-query-e4m3": ("fused_qk_norm_rope_and_reshape_cache_flash",
                                     QkNormCase(kv_cache_dtype="fp8_e5m2", query_out="fp8_e4m3",
                                                num_tokens=17),
                                     {"e4m3", "e5m2"}, [(_QK, "_qk_norm_rope_cache_rows_kernel")]),
    "mla-e4m3": ("concat_and_cache_mla", MlaCase(kv_cache_dtype="fp8"), {"e4m3"},
                 [("kvwrite.ops.concat_and_cache_mla.triton_impl", "_mla_kernel")]),
    "mla-ds": ("concat_and_cache_mla", MlaCase(kv_cache_dtype="fp8_ds_mla"), {"e4m3"},
               [("kvwrite.ops.concat_and_cache_mla.triton_impl", "_mla_kernel")]),
    "indexer": ("indexer_k_quant_and_cache", IndexerCase(), {"e4m3"},
                [("kvwrite.ops.indexer_k_quant_and_cache.triton_impl", "_indexer_kernel")]),
    "per-token-head-fp8": ("reshape_and_cache_flash_per_token_head_quant",
                           PthCase(kv_quant_mode=PTH_FP8, num_tokens=1024, num_blocks=64),
                           {"e4m3"},
                           [("kvwrite.ops.reshape_and_cache_flash_per_token_head_quant"
                             ".triton_impl", "_pth_kernel")]),
}


def launch_writes(record) -> None:
    """Each call of WRITES through its op's public function, implementation="triton", with its
    kernels replaced by ``record(id, module, name)`` (an object subscripted by the grid whose
    result takes the launch's arguments) and the implementation taken as available there (CPU
    tensors: no kernel runs)."""
    saved = []

    def put(obj, attr, value):
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    try:
        for id_, (op, case, _, kernels) in WRITES.items():
            impl = importlib.import_module(f"kvwrite.ops.{op}.triton_impl")
            put(impl, "available", lambda device: None)
            put(impl, "unsupported", lambda *args: None)
            for module, name in kernels:
                put(importlib.import_module(module), name, record(id_, module, name))
            p = conformance.provider(op)
            p.call(*p.build(case, "cpu", 0), implementation="triton")
            while saved:
                obj, attr, value = saved.pop()
                setattr(obj, attr, value)
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


# Run outside the interpreter (compiled kernels): each launch of launch_writes compiled by
# Triton (ASTSource, the launch's arguments and constants, pointers and integers divisible by 16
# taken as 16-byte aligned, as a launch specializes them) for sm_80 with NATIVE false and for
# sm_90 with NATIVE true (what triton_support.native_fp8 gives each), its PTX's float8 mentions
# and conversions counted.
_COMPILE = r"""
import importlib, json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import test_fp8_code as T
TY = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
      torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}
out = {}

def record(id_, module, name):
    kernel = getattr(importlib.import_module(module), name)
    names = kernel.arg_names
    skip = {p.name for p in kernel.params if p.do_not_specialize}

    class Launch:
        def __getitem__(self, grid):
            def call(*args, **kw):
                sig, consts, attrs, opts = {}, {}, {}, {}
                given = dict(zip(names, args))
                given.update({n: v for n, v in kw.items() if n in names})
                opts = {n: v for n, v in kw.items() if n not in names}
                for i, n in enumerate(names):
                    v = given[n]
                    if kernel.params[i].is_constexpr or v is None:
                        sig[n] = "constexpr"
                        consts[(i,)] = v
                    elif isinstance(v, torch.Tensor):
                        sig[n] = TY[v.dtype]
                        attrs[(i,)] = [["tt.divisibility", 16]]
                    else:
                        sig[n] = "i64" if abs(v) >= 2**31 else "i32"
                        if v % 16 == 0 and n not in skip:
                            attrs[(i,)] = [["tt.divisibility", 16]]
                for arch in (80, 90):
                    consts[(names.index("NATIVE"),)] = arch >= 89
                    if "COMPILED" in names:
                        consts[(names.index("COMPILED"),)] = True
                    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
                    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                         options=opts).asm["ptx"]
                    out[f"{id_}/{name}/sm{arch}"] = {
                        "float8": ptx.count("e4m3") + ptx.count("e5m2"),
                        "e4m3": ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
                        "e5m2": ptx.count("cvt.rn.satfinite.e5m2x2.f32")}
            return call
    return Launch()

T.launch_writes(record)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton.backends.nvidia")
    tests = os.path.dirname(os.path.abspath(__file__))
    return run_triton_script(f"import sys\nsys.path.insert(0, {tests!r})\n" + _COMPILE)


@needs_triton
@pytest.mark.parametrize("id_", list(WRITES))
def test_fp8_writes_compile_for_sm80_and_keep_the_conversion_on_sm90(compiled, id_):
    """sm_80 (A100; Triton has no e4m3 type below sm_89): the kernel compiles, the integer
    form, no float8 type in its PTX. sm_90 (H200): the float8 conversion of each format the
    call writes, as before the integer form existed."""
    _, _, formats, kernels = WRITES[id_]
    for _, name in kernels:
        sm80, sm90 = compiled[f"{id_}/{name}/sm80"], compiled[f"{id_}/{name}/sm90"]
        assert sm80["float8"] == 0, (name, sm80)
        assert {f for f in ("e4m3", "e5m2") if sm90[f] > 0} == formats, (name, sm90)


@needs_triton
@pytest.mark.parametrize("native", [False, True])
def test_fp8_write_launchers_pass_native_fp8(monkeypatch, native):
    """Every launcher of WRITES passes triton_support.native_fp8 of the call's device as its
    kernels' NATIVE (faked here: the calls are CPU tensors, no kernel runs)."""
    launched = {}
    seen = []

    def fake(device):
        seen.append(device)
        return native

    def record(id_, module, name):
        class Launch:
            def __getitem__(self, grid):
                def call(*args, **kw):
                    launched[id_, name] = kw["NATIVE"]
                return call
        return Launch()

    monkeypatch.setattr(triton_support, "native_fp8", fake)
    launch_writes(record)
    assert launched == {(i, n): native for i, (*_, ks) in WRITES.items() for _, n in ks}
    assert seen and all(d == torch.device("cpu") for d in seen)

