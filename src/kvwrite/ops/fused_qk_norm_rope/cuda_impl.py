"""The CUDA implementation of fused_qk_norm_rope: ``kernel.cu`` compiled at run time with NVRTC
(kvwrite.kernels.nvrtc); the per-head arithmetic lives in ``kvw/qk_norm.cuh``, shared with the
fused cache-writing op, whose launcher takes its lane layout, widths and builds from here.

Lane layout (:func:`plan`, kvw/qk_norm.cuh's QknLayout): a head row of D elements, padded to P =
next_pow2(D), is held by a group of L = P / E lanes, each with E elements, E = min(P, max(P / 32,
chunks * 16 bytes of the row's dtype)) (:func:`lane_layout`): one 16-byte chunk per lane in the
small-call build (bfloat16 D=128: 16 lanes of 8 elements), two in the large-call build (8 lanes
of 16). Widths: each lane's elements are loaded and stored in chunks of V elements (the widest
power of two dividing E and D, at most 16 bytes, with every pointer and stride aligned to it,
qkv's token and head strides included: a head stride that breaks 16-byte alignment, such as 81
elements, narrows the chunks; dense heads never do, :func:`vector_width`), its weights in chunks
of VW, its table entries in chunks of VT. Where a lane holds more than one full 16-byte chunk
and the rotation's partners then stay in the lane (neox: rot/2 a multiple of L * V; GPT-J:
always), its chunks are interleaved with the other lanes' (segments of SEG = V elements, L * V
apart: every warp access covers consecutive bytes, and the neox partner of a chunk is the lane's
own chunk PS = rot / (2 * L * V) segments on);
otherwise a lane holds E consecutive elements (SEG = E) and neox partners come through shared
memory. Variants (template arguments): row, table and weight dtypes, E, L, SEG, V, VW, VT,
pairing, PS, the position index type, the CTA's threads and the register bound. Each call
signature takes its own build with the arguments it fixes (the token and head strides, the head
counts, D, rot, eps, the weight offset) compiled in (``CudaTuning.specialize``). Calls of at least
``CudaTuning.large_call_bytes`` of rows take the large-call build (two chunks per lane, narrower
CTAs, a register bound, no early trigger of the next kernel). Launched on PyTorch's current
stream; no allocation and no host sync per call (graph-safe).
"""

from __future__ import annotations

import dataclasses

import torch

from ...kernels import launch, nvrtc
from ...kernels.launch import int_type, kind
from ...kernels.triton_support import next_pow2
from .op import float32_bits

__all__ = ["available", "unsupported", "run", "SOURCE", "KERNEL", "THREADS", "NO_WEIGHT",
           "lane_layout", "vector_width", "weight_width", "table_width", "weight_kind",
           "kernel_name", "all_kernel_names", "fixed_args", "CudaTuning", "TUNING", "Plan",
           "plan", "layout_plan", "Build", "SMALL", "bounded", "call_build", "load_build",
           "call_kernel"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_qk_norm_rope")
KERNEL = "qk_norm_rope_kernel"
# kvw/qk_norm.cuh's QKN_THREADS (the small-call build's CTA) and QKN_NO_WEIGHT.
THREADS = 128
NO_WEIGHT = 6

available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(qkv, q_weight, k_weight, cos_sin_cache, is_neox) -> str | None:
    return None


def weight_kind(w: torch.Tensor | None) -> int:
    return NO_WEIGHT if w is None else kind(w.dtype)


def lane_layout(head_size: int, in_bytes: int, chunks: int = 1) -> tuple[int, int]:
    """(E, L): elements per lane and lanes per head group for ``chunks`` 16-byte chunks of the
    row per lane (see the module doc)."""
    p = next_pow2(head_size)
    e = min(p, max(-(-p // 32), chunks * (16 // in_bytes)))
    return e, p // e


def vector_width(head_size: int, e: int, rows: tuple[tuple[int, int, tuple[int, ...]], ...],
                 in_bytes: int) -> int:
    """V: the widest power of two dividing E and D with ``V * in_bytes <= 16`` such that every
    row tensor's (address, element size, strides in elements) is aligned to V elements."""
    v = min(e, max(1, 16 // in_bytes))
    while v > 1:
        ok = head_size % v == 0 and e % v == 0
        ok = ok and all(launch.aligned(p, v * es) and all(s % v == 0 for s in strides)
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
        ok = ok and all(v * w.element_size() <= 16
                        and launch.aligned(w.data_ptr(), v * w.element_size()) for w in present)
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
        if half % v == 0 and per_lane % v == 0 and launch.aligned(table.data_ptr(), v * es):
            return v
        v //= 2
    return 1


@dataclasses.dataclass(frozen=True)
class Build:
    """A call's build: the 16-byte chunks per lane, the CTA's threads, __launch_bounds__'s
    minimum of resident CTAs, whether its PDL twin triggers the next kernel early."""

    chunks: int = 1
    cta: int = THREADS
    min_blocks: int = 1
    trigger: bool = True


SMALL = Build()


def kernel_name(in_kind: int, cs_kind: int, wq: int, wk: int, p: Plan, neox: bool,
                pos: torch.dtype, build: Build = SMALL) -> str:
    return (f"{KERNEL}<{in_kind}, {cs_kind}, {wq}, {wk}, {p.e}, {p.lanes}, {p.seg}, {p.v}, "
            f"{p.vw}, {p.vt}, {str(neox).lower()}, {p.ps}, {int_type(pos)}, {build.cta}, "
            f"{build.min_blocks}>")


def all_kernel_names() -> list[str]:
    """A representative set of variants (for the NVRTC compile test): every row dtype with its
    layouts of D = 64, 128 and 512 (and D = 80, 46) in the small-call and the large-call build,
    both pairings, partial rotary, weights of every kind and none, narrower widths, int32
    positions."""
    names = set()
    f32, bf16, f16 = kind(torch.float32), kind(torch.bfloat16), kind(torch.float16)
    for in_dt in (torch.float16, torch.bfloat16, torch.float32):
        k = kind(in_dt)
        # Generic builds (this set): the large-call build takes no register bound (bounded()).
        for build in (SMALL, dataclasses.replace(TUNING.large_build(), min_blocks=1)):
            for d in (64, 80, 128, 46, 512):
                for neox, rot in ((True, d), (False, d), (True, d // 2)):
                    p = layout_plan(d, in_dt.itemsize, rot, neox, build.chunks)
                    names.add(kernel_name(k, f32, k, k, p, neox, torch.int64, build))
        e, lanes = lane_layout(128, in_dt.itemsize)
        for wq, wk in ((NO_WEIGHT, f32), (bf16, NO_WEIGHT), (f16, f32), (NO_WEIGHT, NO_WEIGHT)):
            names.add(kernel_name(k, k, wq, wk, Plan(e, lanes, e, 2, 1, 1, 0), True,
                                  torch.int32))
            names.add(kernel_name(k, bf16, wq, wk, Plan(e, lanes, e, 1, 2, 2, 0), False,
                                  torch.int64))
    return sorted(names)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A call's lane layout and widths (kvw/qk_norm.cuh): E elements per lane, L lanes, segments
    of SEG elements, chunks of V (rows), VW (weights), VT (table entries), the neox partners PS
    segments on in the lane (0: across lanes, or GPT-J)."""

    e: int
    lanes: int
    seg: int
    v: int
    vw: int
    vt: int
    ps: int


def _pairs_in_lane(head_size: int, rot: int, is_neox: bool, lanes: int, v: int) -> int | None:
    """PS of an interleaved layout with segments of V elements (0 for GPT-J), or None where the
    neox partners would lie in other lanes."""
    if not is_neox:
        return 0 if v % 2 == 0 else None
    half = rot // 2
    if half % (lanes * v):
        return None
    return half // (lanes * v)


def layout_plan(head_size: int, in_bytes: int, rot: int, is_neox: bool, chunks: int = 1,
                v: int | None = None, vw: int | None = None, vt: int | None = None) -> Plan:
    """The plan of a row of ``head_size`` elements of ``in_bytes`` with ``chunks`` 16-byte chunks
    per lane, all pointers and strides aligned to 16 bytes unless ``v`` (the row's chunk) says
    otherwise; ``vw`` and ``vt`` default to the widest the segments allow (at most 16 bytes of
    float32 entries). Interleaved where a lane holds more than one full chunk and the rotation's
    partners stay in the lane; else, with ``chunks`` > 1, the one-chunk plan."""
    e, lanes = lane_layout(head_size, in_bytes, chunks)
    full = min(e, 16 // in_bytes)
    if v is None:
        v = full
        while head_size % v:
            v //= 2
    seg, ps = e, 0
    if e > v == full and (found := _pairs_in_lane(head_size, rot, is_neox, lanes, v)) is not None:
        seg, ps = v, found
    elif chunks > 1:
        return layout_plan(head_size, in_bytes, rot, is_neox, 1, None if v == full else v, vw,
                           vt)

    def widest(n: int, limit: int) -> int:
        w = 1
        while w * 2 <= min(n, limit) and n % (w * 2) == 0 and head_size % (w * 2) == 0:
            w *= 2
        return w

    if vw is None:
        vw = widest(seg, 16 // min(in_bytes, 4))
    if vt is None:
        per = seg if is_neox else seg // 2
        vt = 1
        while vt * 2 <= min(per, 4) and per % (vt * 2) == 0 and (rot // 2) % (vt * 2) == 0:
            vt *= 2
    return Plan(e, lanes, seg, v, vw, vt, ps)


def plan(qkv: torch.Tensor, q_weight, k_weight, cos_sin_cache: torch.Tensor, is_neox: bool,
         extra_rows: tuple[tuple[int, int, tuple[int, ...]], ...] = (), chunks: int = 1) -> Plan:
    """The layout and widths of a call on ``qkv`` (``[T_pad, H, D]``, any token and head
    strides: both count for the chunks' alignment) with ``chunks`` 16-byte chunks per lane;
    ``extra_rows``: (address, element size, strides) of other tensors the kernel accesses in
    V-element chunks (the fused op's query_out and caches)."""
    d = qkv.shape[2]
    es = qkv.element_size()
    rot = cos_sin_cache.shape[1]
    strides = tuple(s for s, n in zip(qkv.stride()[:2], qkv.shape[:2], strict=True) if n > 1)
    rows = ((qkv.data_ptr(), es, strides),) + tuple(extra_rows)
    e, lanes = lane_layout(d, es, chunks)
    v = vector_width(d, e, rows, es)
    if chunks > 1 and (v < min(e, 16 // es) or
                       _pairs_in_lane(d, rot, is_neox, lanes, v) is None):
        return plan(qkv, q_weight, k_weight, cos_sin_cache, is_neox, extra_rows)
    p = layout_plan(d, es, rot, is_neox, chunks, v)
    return dataclasses.replace(p, vw=weight_width(d, p.seg, (q_weight, k_weight)),
                               vt=table_width(p.seg, rot, is_neox, cos_sin_cache))


@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants; ``TUNING`` unless a caller passes another to :func:`run`. The
    large-call fields are predictions from the kernel's machine code and from what made
    fused_rope_and_reshape_cache_flash's kernel fast (tuning-log changes 34-36, 44, 53): not
    measured on this kernel yet."""

    # One build per call signature with the arguments from qkv_stride on compiled in
    # (kernel.cu's KVWRITE_FIXED_ARGS), as the other ops; KVWRITE_CUDA_SPECIALIZE=0: one generic
    # build per variant.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)
    # Calls that move at least large_call_bytes of the heads' rows (query and key here; query,
    # key and value in the fused op) take the large-call build (not measured):
    # - large_call_chunks 16-byte chunks of the row per lane, interleaved across the group's
    #   lanes where the rotation's partners stay in the lane (bfloat16 D = 128: 8 lanes of two
    #   chunks 128 bytes apart, the neox pairs in the lane: no shared-memory exchange), so twice
    #   the bytes in flight per thread, half the threads, half the per-lane root computations;
    # - CTAs of large_call_cta_threads (Qwen3-8B's 40 heads x 8 lanes = 5 CTAs of 64 per token,
    #   4 of query heads and 1 of key heads: none mixes the two paths);
    # - __launch_bounds__(cta, large_call_min_blocks): the register bound (48 registers with 64
    #   threads and 20 CTAs);
    # - large_call_pdl_trigger: whether its PDL twin triggers the next kernel early (the fused
    #   RoPE kernel's large build lost 4.5-7.5% with the trigger, tuning-log change 44).
    large_call_bytes: int = 4 << 20
    large_call_chunks: int = 2
    large_call_cta_threads: int = 64
    large_call_min_blocks: int = 20
    large_call_pdl_trigger: bool = False

    def __post_init__(self):
        c = self.large_call_cta_threads
        if not (isinstance(c, int) and 32 <= c <= 1024 and c % 32 == 0):
            raise ValueError(f"large_call_cta_threads: expected a multiple of 32 in [32, 1024], "
                             f"got {c!r}")
        if self.large_call_chunks not in (1, 2, 4):
            raise ValueError(f"large_call_chunks: expected 1, 2 or 4, got "
                             f"{self.large_call_chunks!r}")

    def large_build(self) -> Build:
        return Build(self.large_call_chunks, self.large_call_cta_threads,
                     self.large_call_min_blocks, self.large_call_pdl_trigger)


TUNING = CudaTuning()


def call_build(row_bytes: int, tuning: CudaTuning = TUNING) -> Build:
    """The build of a call that moves ``row_bytes`` of the heads' rows."""
    return tuning.large_build() if row_bytes >= tuning.large_call_bytes else SMALL


def fixed_args(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
               cos_sin_cache: torch.Tensor, weight_offset: float) -> tuple[int, ...]:
    """The kernel's arguments from qkv_stride on (kernel.cu's KVWRITE_FIXED_ARGS order), all set
    by the call signature: qkv's token and head strides, max_position, Hq, Hq + Hk, D, rot, the
    bits of float32(eps) and float32(weight_offset), whether the offset is added."""
    return (qkv.stride(0), qkv.stride(1), cos_sin_cache.shape[0], num_heads_q,
            num_heads_q + num_heads_k, qkv.shape[2], cos_sin_cache.shape[1], float32_bits(eps),
            float32_bits(weight_offset), int(weight_offset != 0))


def bounded(build: Build, p: Plan, specialize: bool, q_weight, k_weight,
            in_bytes: int) -> Build:
    """``build`` with its register bound where it applies: the large-call bound is chosen for the
    specialized builds of the interleaved layout with no weight or weights of one dtype no wider
    than the rows' (no spill there, tests/test_qk_norm_rope.py). A generic build (more registers
    for its run-time arguments), a call whose layout stayed consecutive (its neox partners
    across lanes, or unaligned rows) or one with wider weights or weights of two dtypes (twice
    the weights' registers: 56 bytes spilled) takes none."""
    dtypes = {w.dtype for w in (q_weight, k_weight) if w is not None}
    lean = len(dtypes) <= 1 and all(d.itemsize <= in_bytes for d in dtypes)
    if build.min_blocks > 1 and (not specialize or p.seg == p.e or not lean):
        return dataclasses.replace(build, min_blocks=1)
    return build


def call_kernel(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
                q_weight, k_weight, cos_sin_cache: torch.Tensor, is_neox: bool,
                position_ids: torch.Tensor, weight_offset: float, build: Build = SMALL,
                specialize: bool = True) -> tuple[str, Plan, tuple[int, ...], Build]:
    """(kernel name, plan, fixed arguments, build) of a call taking ``build`` (CPU tensors too:
    the tests read the machine code of what calls take)."""
    p = plan(qkv, q_weight, k_weight, cos_sin_cache, is_neox, chunks=build.chunks)
    build = bounded(build, p, specialize, q_weight, k_weight, qkv.element_size())
    fixed = fixed_args(qkv, num_heads_q, num_heads_k, eps, cos_sin_cache, weight_offset)
    name = kernel_name(kind(qkv.dtype), kind(cos_sin_cache.dtype), weight_kind(q_weight),
                       weight_kind(k_weight), p, is_neox, position_ids.dtype, build)
    return name, p, fixed, build


LAUNCHES = launch.LaunchCache()


def load_build(source: nvrtc.KernelSource, name: str, fixed: tuple, p: Plan, build: Build,
               heads: int, index: int, specialize: bool) -> launch.Launchable:
    """Variant ``name`` of ``source`` loaded for device ``index`` (``build``'s PDL twin
    triggering the next kernel or not) with ``heads`` heads of ``p.lanes`` lanes a token: its
    plan is (threads per token, CTA threads). fused_qk_norm_rope_and_reshape_cache_flash's too."""
    kernel, pdl_kernel = launch.load(source, name, fixed, index, specialize, trigger=build.trigger)
    return launch.Launchable(kernel, pdl_kernel, index, fixed, (heads * p.lanes, build.cta))


def _launchable(qkv, num_heads_q, num_heads_k, eps, q_weight, k_weight, cos_sin_cache, is_neox,
                position_ids, weight_offset, specialize, build) -> launch.Launchable:
    launch.require_setup()
    name, p, fixed, build = call_kernel(qkv, num_heads_q, num_heads_k, eps, q_weight, k_weight,
                                        cos_sin_cache, is_neox, position_ids, weight_offset,
                                        build, specialize)
    return load_build(SOURCE, name, fixed, p, build, num_heads_q + num_heads_k,
                      qkv.get_device(), specialize)


def run(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
        weight_offset: float, *, tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_rot = position_ids.numel()
    if num_rot == 0:
        return
    qw, kw = launch.ptr(q_weight), launch.ptr(k_weight)
    build = call_build(num_rot * (num_heads_q + num_heads_k) * qkv.shape[2] *
                       qkv.element_size(), tuning)
    sig = (qkv.dtype, cos_sin_cache.dtype, position_ids.dtype, qkv.shape[1:], qkv.stride()[:2],
           num_heads_q, num_heads_k, eps, weight_offset, cos_sin_cache.shape,
           None if q_weight is None else q_weight.dtype,
           None if k_weight is None else k_weight.dtype,
           qkv.data_ptr() & 15, cos_sin_cache.data_ptr() & 15, qw & 15, kw & 15, is_neox,
           qkv.get_device(), tuning.specialize, build)
    lau = LAUNCHES.get(sig)
    if lau is None:
        lau = LAUNCHES[sig] = _launchable(qkv, num_heads_q, num_heads_k, eps, q_weight,
                                          k_weight, cos_sin_cache, is_neox, position_ids,
                                          weight_offset, tuning.specialize, build)
    per_token, cta = lau.plan
    ctas = -(-(num_rot * per_token) // cta)
    kernel, pdl = lau.pick(ctas, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(ctas, 1, cta, 1, pdl)
    nvrtc.launch(lau.device_index, config, kernel,
                 position_ids.data_ptr(), qkv.data_ptr(), cos_sin_cache.data_ptr(), qw, kw,
                 num_rot, *lau.fixed)
