"""The CUDA implementation of fused_qk_norm_rope: ``kernel.cu`` compiled at run time with NVRTC
(kvwrite.kernels.nvrtc); the per-head arithmetic lives in ``kvw/qk_norm.cuh``, shared with the
fused cache-writing op, whose launcher takes its lane layout and widths from here.

Lane layout (:func:`lane_layout`): a head row of D elements, padded to P = next_pow2(D), is held
by a group of L = P / E lanes, each with E consecutive elements, E = min(P, max(P / 32, 16 bytes
of the row's dtype)): a 16-byte row chunk per lane where the row allows (bfloat16 D=128: 16
lanes of 8 elements, two heads per warp; D=512: 32 lanes of 16). Widths (:func:`vector_width`,
:func:`weight_width`, :func:`table_width`): each lane's elements are loaded and stored in chunks
of V elements (the widest power of two dividing E and D, at most 16 bytes, with every pointer and
stride aligned to it), its weights in chunks of VW, its table entries in chunks of VT (dividing
rot/2). Variants (template arguments): row, table and weight dtypes, E, L, V, VW, VT, pairing
and the position index type. Each call signature takes its own build with the arguments it fixes
(the token stride, the head counts, D, rot, eps, the weight offset) compiled in
(``CudaTuning.specialize``). Launched on PyTorch's current stream; no allocation and no host sync
per call (graph-safe).
"""

from __future__ import annotations

import dataclasses

import torch

from ...kernels import nvrtc
from ...kernels.triton_support import next_pow2
from ..rotary_embedding.cuda_impl import int_type, kind
from .op import float32_bits

__all__ = ["available", "unsupported", "run", "SOURCE", "KERNEL", "THREADS", "NO_WEIGHT",
           "lane_layout", "vector_width", "weight_width", "table_width", "weight_kind",
           "kernel_name", "all_kernel_names", "fixed_args", "CudaTuning", "TUNING", "Plan",
           "plan"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_qk_norm_rope")
KERNEL = "qk_norm_rope_kernel"
# kvw/qk_norm.cuh's QKN_THREADS and QKN_NO_WEIGHT.
THREADS = 128
NO_WEIGHT = 6

available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(qkv, q_weight, k_weight, cos_sin_cache, is_neox) -> str | None:
    return None


def weight_kind(w: torch.Tensor | None) -> int:
    return NO_WEIGHT if w is None else kind(w.dtype)


def _aligned(ptr: int, nbytes: int) -> bool:
    return ptr % min(nbytes, 16) == 0


def lane_layout(head_size: int, in_bytes: int) -> tuple[int, int]:
    """(E, L): elements per lane and lanes per head group (see the module doc)."""
    p = next_pow2(head_size)
    e = min(p, max(-(-p // 32), 16 // in_bytes))
    return e, p // e


def vector_width(head_size: int, e: int, rows: tuple[tuple[int, int, tuple[int, ...]], ...],
                 in_bytes: int) -> int:
    """V: the widest power of two dividing E and D with ``V * in_bytes <= 16`` such that every
    row tensor's (address, element size, strides in elements) is aligned to V elements."""
    v = min(e, max(1, 16 // in_bytes))
    while v > 1:
        ok = head_size % v == 0 and e % v == 0
        ok = ok and all(_aligned(p, v * es) and all(s % v == 0 for s in strides)
                        for p, es, strides in rows)
        if ok:
            return v
        v //= 2
    return 1


def weight_width(head_size: int, e: int, weights) -> int:
    """VW: the widest power of two dividing E and D whose chunks of every weight are at most 16
    bytes and aligned."""
    present = [w for w in weights if w is not None]
    v = e
    while v > 1:
        ok = head_size % v == 0 and e % v == 0
        ok = ok and all(v * w.element_size() <= 16 and _aligned(w.data_ptr(), v * w.element_size())
                        for w in present)
        if ok:
            return v
        v //= 2
    return 1


def table_width(e: int, rot: int, is_neox: bool, table: torch.Tensor) -> int:
    """VT: table entries per chunk, the widest power of two dividing rot/2 and E (neox) or E/2
    (GPT-J), at most 16 bytes, with the table's address aligned to it."""
    half = rot // 2
    per_lane = e if is_neox else e // 2
    es = table.element_size()
    v = max(1, min(per_lane, 16 // es))
    while v > 1:
        if half % v == 0 and per_lane % v == 0 and _aligned(table.data_ptr(), v * es):
            return v
        v //= 2
    return 1


def kernel_name(in_kind: int, cs_kind: int, wq: int, wk: int, e: int, lanes: int, v: int,
                vw: int, vt: int, neox: bool, pos: torch.dtype) -> str:
    return (f"{KERNEL}<{in_kind}, {cs_kind}, {wq}, {wk}, {e}, {lanes}, {v}, {vw}, {vt}, "
            f"{str(neox).lower()}, {int_type(pos)}>")


def all_kernel_names() -> list[str]:
    """A representative set of variants (for the NVRTC compile test): every row dtype with its
    widest layout of D = 64, 128 and 512 (and D = 80, 46), both pairings, weights of every kind
    and none, narrower widths, int32 positions."""
    names = set()
    f32, bf16, f16 = kind(torch.float32), kind(torch.bfloat16), kind(torch.float16)
    for in_dt in (torch.float16, torch.bfloat16, torch.float32):
        k = kind(in_dt)
        for d in (64, 80, 128, 46, 512):
            e, lanes = lane_layout(d, in_dt.itemsize)
            v = e
            while v > 1 and (d % v or v * in_dt.itemsize > 16):
                v //= 2
            for neox in (True, False):
                vt = min(e if neox else e // 2, 4)
                names.add(kernel_name(k, f32, k, k, e, lanes, v, v, vt, neox, torch.int64))
        e, lanes = lane_layout(128, in_dt.itemsize)
        for wq, wk in ((NO_WEIGHT, f32), (bf16, NO_WEIGHT), (f16, f32), (NO_WEIGHT, NO_WEIGHT)):
            names.add(kernel_name(k, k, wq, wk, e, lanes, 2, 1, 1, True, torch.int32))
            names.add(kernel_name(k, bf16, wq, wk, e, lanes, 1, 2, 2, False, torch.int64))
    return sorted(names)


@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning:
    """The launch constants; ``TUNING`` unless a caller passes another to :func:`run`."""

    # Calls of at most pdl_max_ctas CTAs take the KVWRITE_PDL build and launch with programmatic
    # stream serialization where the device allows it (as rotary_embedding's CudaTuning); 0:
    # never.
    pdl_max_ctas: int = 1 << 30
    # One build per call signature with the arguments from qkv_stride on compiled in
    # (kernel.cu's KVWRITE_FIXED_ARGS), as the other ops; KVWRITE_CUDA_SPECIALIZE=0: one generic
    # build per variant.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)


TUNING = CudaTuning()


@dataclasses.dataclass(frozen=True)
class Plan:
    """A call's lane layout and widths."""

    e: int
    lanes: int
    v: int
    vw: int
    vt: int


def plan(qkv: torch.Tensor, q_weight, k_weight, cos_sin_cache: torch.Tensor, is_neox: bool,
         extra_rows: tuple[tuple[int, int, tuple[int, ...]], ...] = ()) -> Plan:
    """The layout and widths of a call on ``qkv`` (``[T_pad, H, D]``); ``extra_rows``: (address,
    element size, strides) of other tensors the kernel accesses in V-element chunks (the fused
    op's query_out and caches)."""
    d = qkv.shape[2]
    e, lanes = lane_layout(d, qkv.element_size())
    strides = (qkv.stride(0),) if qkv.shape[0] > 1 else ()
    rows = ((qkv.data_ptr(), qkv.element_size(), strides),) + tuple(extra_rows)
    return Plan(e, lanes, vector_width(d, e, rows, qkv.element_size()),
                weight_width(d, e, (q_weight, k_weight)),
                table_width(e, cos_sin_cache.shape[1], is_neox, cos_sin_cache))


def fixed_args(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
               cos_sin_cache: torch.Tensor, weight_offset: float) -> tuple[int, ...]:
    """The kernel's arguments from qkv_stride on (kernel.cu's KVWRITE_FIXED_ARGS order), all set
    by the call signature: qkv's token stride, max_position, Hq, Hq + Hk, D, rot, the bits of
    float32(eps) and float32(weight_offset), whether the offset is added."""
    return (qkv.stride(0), cos_sin_cache.shape[0], num_heads_q, num_heads_q + num_heads_k,
            qkv.shape[2], cos_sin_cache.shape[1], float32_bits(eps), float32_bits(weight_offset),
            int(weight_offset != 0))


@dataclasses.dataclass(frozen=True)
class _Launchable:
    kernel: object
    pdl_kernel: object  # the KVWRITE_PDL build, None where the device cannot take it
    lanes: int
    units_per_token: int
    device_index: int
    fixed: tuple


_LAUNCHABLES: dict[tuple, _Launchable] = {}


def _launchable(qkv, num_heads_q, num_heads_k, eps, q_weight, k_weight, cos_sin_cache, is_neox,
                position_ids, weight_offset, specialize) -> _Launchable:
    reason = nvrtc.setup_reason()
    if reason is not None:
        raise RuntimeError(reason)
    p = plan(qkv, q_weight, k_weight, cos_sin_cache, is_neox)
    fixed = fixed_args(qkv, num_heads_q, num_heads_k, eps, cos_sin_cache, weight_offset)
    name = kernel_name(kind(qkv.dtype), kind(cos_sin_cache.dtype), weight_kind(q_weight),
                       weight_kind(k_weight), p.e, p.lanes, p.v, p.vw, p.vt, is_neox,
                       position_ids.dtype)
    macros = nvrtc.fixed_args_macros(fixed if specialize else None)
    index = qkv.get_device()
    with nvrtc.capture_relaxed():
        nvrtc.cuda_core().Device(index).set_current()
        arch, _ = nvrtc.device_arch(index)
        kernel = SOURCE.kernel(arch, name, macros)
        pdl_kernel = nvrtc.pdl_twin(SOURCE, arch, name, macros, index)
    return _Launchable(kernel, pdl_kernel, p.lanes, num_heads_q + num_heads_k, index, fixed)


def _ptr(w: torch.Tensor | None) -> int:
    return 0 if w is None else w.data_ptr()


def run(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
        weight_offset: float, *, tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_rot = position_ids.numel()
    if num_rot == 0:
        return
    qw, kw = _ptr(q_weight), _ptr(k_weight)
    sig = (qkv.dtype, cos_sin_cache.dtype, position_ids.dtype, qkv.shape[1:], qkv.stride(0),
           num_heads_q, num_heads_k, eps, weight_offset, cos_sin_cache.shape,
           None if q_weight is None else q_weight.dtype,
           None if k_weight is None else k_weight.dtype,
           qkv.data_ptr() & 15, cos_sin_cache.data_ptr() & 15, qw & 15, kw & 15, is_neox,
           qkv.get_device(), tuning.specialize)
    lau = _LAUNCHABLES.get(sig)
    if lau is None:
        lau = _LAUNCHABLES[sig] = _launchable(qkv, num_heads_q, num_heads_k, eps, q_weight,
                                              k_weight, cos_sin_cache, is_neox, position_ids,
                                              weight_offset, tuning.specialize)
    threads = num_rot * lau.units_per_token * lau.lanes
    ctas = -(-threads // THREADS)
    pdl = nvrtc.takes_pdl(lau.pdl_kernel, ctas, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(ctas, 1, THREADS, 1, pdl)
    nvrtc.launch(lau.device_index, config, lau.pdl_kernel if pdl else lau.kernel,
                 position_ids.data_ptr(), qkv.data_ptr(), cos_sin_cache.data_ptr(), qw, kw,
                 num_rot, *lau.fixed)
