"""The CUDA implementation of reshape_and_cache_turboquant: ``kernel.cu`` compiled at run time with
NVRTC (through :mod:`kvwrite.kernels.nvrtc`), launched on PyTorch's current stream.

``tq_kernel<IN, KB, VB, SlotT, E, CTA>`` (see ``kernel.cu``): a row (token, head) is ``P / E``
neighbouring lanes of a warp, each holding ``E`` elements (:func:`lanes`), the CTAs of
:func:`cta_threads` threads striding over the rows (a grid of at most the resident CTAs). Before
it, for the MSE presets where D is a power of two, ``tq_check_kernel`` (:data:`CHECK_KERNEL`)
checks the rotation table once a call, spread over :func:`check_ctas` CTAs, for the Sylvester
Hadamard, whose product ``tq_kernel`` then takes by the fast Walsh-Hadamard transform, bit-exact
with the tree (larger calls' CTAs check the table themselves). The MSE presets' smallest calls
(:func:`split_elems`) take ``tq_split_kernel`` instead: a warp a row's 8 outputs (its 8
columns of the table), the products' trees for any table, so no check. Every step of SPEC §10.2
is one explicitly rounded PTX instruction (no contraction, no flush), the sums by the padded
pairwise tree, so the bytes are the reference's. Head sizes up to ``MAX_HEAD_SIZE``; longer ones are
unsupported here (torch runs them). By default each signature of the MSE presets' calls, and of
k8v4's up to ``CudaTuning.specialize_rows`` rows, gets its own build of its kernel with the
arguments fixed by the views compiled in (:func:`fixed_args`, :func:`specialized`).

``run`` takes the arguments the public op validated and the preset's record (any object with the
fields ``key_bits``, ``value_bits``, ``mse``, ``key_packed_size``, ``value_data_bytes``,
``slot_size``). Graph-safe: no host sync per call (the table check runs on the GPU at every call,
its flags in a buffer from PyTorch's allocator on the current stream). Measured in
docs/tuning-log.md (changes 80, 91, 115 and 118 to 124).
"""

from __future__ import annotations

import dataclasses

import torch

from ...kernels import launch, nvrtc
from ...kernels.triton_support import next_pow2

__all__ = ["CudaTuning", "TUNING", "available", "unsupported", "run", "kernel_name",
           "all_kernel_names", "compile_kernel", "launch_args", "lanes", "min_elems",
           "cta_options", "cta_threads", "row_warps", "grid", "check_ctas", "CHECK_KERNEL",
           "SOURCE", "MAX_HEAD_SIZE", "LANE_ELEMS", "split_elems", "split_grid",
           "split_kernel_name", "split_args", "SPLIT_THREADS", "SPLIT_ELEMS", "FIXED_ARGS",
           "fixed_args", "specialized"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_turboquant")
KERNEL = "tq_kernel"
# The MSE presets' small calls (split_elems): one warp a (row, 8 outputs), CTAs of
# SPLIT_THREADS, E = P / 32 elements a lane for P = 64 and 128 (P = 256, E = 8: T = 1 at H = 8
# took 4.25 us against tq_kernel's 4.32, T = 2 6.00 against 4.37; tuning-log 122).
SPLIT_KERNEL = "tq_split_kernel"
SPLIT_THREADS = 128
SPLIT_ELEMS = (2, 4)
SPLIT_COORDS = 8  # kernel.cu's TQ_SPLIT_J
# The table check: CTAs of CHECK_THREADS threads, four entries a thread (check_ctas).
CHECK_THREADS = 256
CHECK_KERNEL = f"tq_check_kernel<{CHECK_THREADS}>"
MAX_HEAD_SIZE = 1024  # kernel.cu's TQ_MAXP
LANE_ELEMS = (2, 4, 8, 16, 32)  # the kernel's E variants
# (key bits, value bits) of the four presets (SPEC §10.1).
BITS = ((8, 4), (4, 4), (3, 4), (3, 3))

# Both kernels' trailing arguments, fixed by a call's signature (kernel.cu's TQ_FIXED_PARAMS),
# in order: what a specialized build compiles in.
FIXED_ARGS = ("num_heads", "head_size", "p2", "k_tok", "k_head", "v_tok", "v_head", "c_blk",
              "c_page", "c_head", "block_size", "block_shift", "num_slots", "pit_s0", "pit_s1",
              "mid_s")

# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 16 trailing arguments compiled in (KernelSource.compile_fixed); tests.
compile_kernel = SOURCE.compile_fixed


@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants: ``lane_elems`` the elements a lane holds where the row allows
    (16: 32-byte bf16 chunks, 8 lanes a row at D = 128); ``waves`` the CTAs of the grid at most,
    in resident CTAs (SMs times the measured occupancy): each CTA does its setup once (the
    midpoints; a large call's table check), so more CTAs than resident ones only repeat that."""

    lane_elems: int = 16
    waves: int = 1
    # Calls of at most small_rows (token, head) rows give a lane small_lane_elems elements
    # (more lanes a row: a shorter chain of instructions a lane, where one pass is all there is).
    # Measured on an H200 (H = 8, D = 128, cold; tuning-log 94): E = 8 against 16 at T = 1..512
    # k8v4 0.79-1.005, the MSE presets 0.76-0.98; equal at T = 1024 (8192 rows); E = 4 slower
    # than 8 for k8v4 at every T (one more shuffle level a reduction).
    small_rows: int = 4096
    small_lane_elems: int = 8
    # The MSE presets' small calls (E = 8) put their rows on at least this many warps a CTA
    # (:func:`row_warps`; the CTA's other warps only share its setup): few rows a CTA,
    # more CTAs. 4: one warp with rows a scheduler. H200, H = 8, D = 128, against every warp,
    # cold / hot (tuning-log 120): T = 2 0.94 / 0.95, 4 0.79 / 0.79, 8 to 32 0.92-0.93, 64 0.93 /
    # 0.95-0.97, T = 1 and >= 128 1.00; 2 the same, 8 0.84 at T = 4 and 1.00 at T = 8 to 32.
    mse_row_warps: int = 4
    # Calls of at most check_rows rows (the MSE presets, D a power of two) check the rotation
    # table in a kernel of its own (tq_check_kernel, spread over the table) whose flags
    # tq_kernel's CTAs read; larger ones in each CTA, overlapped with the rows' loads. H200,
    # H = 8, D = 128, against each CTA's own check, cold / hot (tuning-log 121): T = 16 to 256
    # 0.93-0.97 / 0.91-0.94 on the same CTAs (and more CTAs become cheap: cta_threads), T = 1
    # and 4 1.00-1.02 / 0.97, 512 (4096 rows) 1.02 / 0.97; T = 1024 1.02 / 1.00, 4096 and 16384
    # 1.02-1.06 (a serial round trip that the rows' loads no longer hide).
    check_rows: int = 4096
    # The MSE presets' calls whose tq_split_kernel would have at most split_warps warps (rows
    # times ceil(D / 8)) run it (a row's rotation spread over D / 8 warps, no table check)
    # instead of the table check and tq_kernel. H200, H = 8, against tq_kernel, cold / hot
    # (tuning-log 122): D = 128 T = 1, 2, 4 (128 to 512 warps) 0.73 / 0.67, 0.74 / 0.68, 0.81 /
    # 0.80, T = 8 1.42 / 1.47; D = 64 T = 1, 4, 8 (64 to 512 warps) 0.66, 0.67, 0.71 cold (T =
    # 16, 1024 warps: 1.13 on a build within 4% of this one). Each warp reads 8 columns of the
    # table, 32 bytes of each row, so a row's D / 8 warps read all of it: the reads, not the
    # work, set the crossover.
    split_warps: int = 512
    # The MSE presets' calls, and k8v4's of at most specialize_rows rows, get one build per call
    # signature with the fixed arguments (FIXED_ARGS) compiled in (NVRTC once per signature and
    # process, about 0.2 s a kernel); k8v4's larger calls, and every call where specialize is
    # off (KVWRITE_CUDA_SPECIALIZE=0), the generic build of their variant. H200, H = 8, D = 128,
    # cold, against the generic build: every preset 0.77-0.84 at T = 1 to 64 (k8v4 1.96 -> 1.56
    # us at T = 1, 4bit_nc 3.02 -> 2.43), 0.84-0.89 at T = 256 (tuning-log 123); T = 1024 /
    # 2048 / 4096 (up to 32768 rows) k8v4 0.88 / 0.94 / 0.95, the MSE presets 0.91-0.94; T =
    # 16384 and 65536 the MSE presets 0.89-0.93, but k8v4 1.07-1.09 (tuning-log 124).
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)
    specialize_rows: int = 32768


TUNING = CudaTuning()


def kernel_name(in_kind: int, key_bits: int, value_bits: int, slot_dtype: torch.dtype,
                elems: int, threads: int) -> str:
    return (f"{KERNEL}<{in_kind}, {key_bits}, {value_bits}, {launch.int_type(slot_dtype)}, "
            f"{elems}, {threads}>")


def split_kernel_name(in_kind: int, key_bits: int, value_bits: int, slot_dtype: torch.dtype,
                      elems: int) -> str:
    return (f"{SPLIT_KERNEL}<{in_kind}, {key_bits}, {value_bits}, "
            f"{launch.int_type(slot_dtype)}, {elems}, {SPLIT_THREADS}>")


def _split_warps(rows: int, head_size: int) -> int:
    """``tq_split_kernel``'s warps: one a (row, slice of SPLIT_COORDS outputs)."""
    return rows * -(-head_size // SPLIT_COORDS)


def split_elems(key_bits: int, head_size: int, rows: int, tuning: CudaTuning = TUNING) -> int:
    """The elements a lane of ``tq_split_kernel`` holds (P / 32) for a call of ``rows`` rows, 0
    where ``tq_kernel`` takes it: k8v4 (no rotation), more than ``tuning.split_warps`` warps
    (rows times ceil(D / 8)), or a padded head size P other than 64 and 128."""
    e = next_pow2(head_size) // 32
    if key_bits == 8 or _split_warps(rows, head_size) > tuning.split_warps or e not in SPLIT_ELEMS:
        return 0
    return e


def split_grid(rows: int, head_size: int) -> int:
    """The CTAs of ``tq_split_kernel``: its warps, SPLIT_THREADS / 32 a CTA."""
    return -(-_split_warps(rows, head_size) // (SPLIT_THREADS // 32))


def lanes(head_size: int, tuning: CudaTuning = TUNING, rows: int | None = None,
          least: int = 2) -> tuple[int, int]:
    """(E, lanes per row) at a head size for a call of ``rows`` rows (None: a large one): E =
    min(P, max(le, P / 32, least)) elements a lane, le the tuning's lane_elems (its
    small_lane_elems at most small_rows rows), P / E <= 32 lanes a row (P the power of two >= D;
    ``least``: :func:`min_elems`, 8 where a field has 3-bit codes: whole bytes a lane)."""
    p = next_pow2(head_size)
    small = rows is not None and rows <= tuning.small_rows
    le = tuning.small_lane_elems if small else tuning.lane_elems
    e = min(p, max(le, p // 32, least))
    return e, p // e


def min_elems(preset) -> int:
    """The fewest elements a lane holds for ``preset``: 8 where a field has 3-bit codes."""
    return 8 if 3 in (int(preset.key_bits), int(preset.value_bits)) else 2


def cta_options(key_bits: int, elems: int) -> tuple[int, ...]:
    """The CTA sizes a variant is built with: 256 at E = 32 (512 rows' shared u would not fit);
    at E = 8 (the small calls' lanes) a small size and 512, k8v4 128, the MSE presets 256
    (:func:`cta_threads`); else 512."""
    if elems >= 32:
        return (256,)
    if elems == 8:
        return (128, 512) if key_bits == 8 else (256, 512)
    return (512,)


def cta_threads(key_bits: int, elems: int, lanes_per_row: int, rows: int, sm_count: int) -> int:
    """The threads of a CTA for a call of ``rows`` rows (one of :func:`cta_options`): a few rows
    spread over more SMs finish sooner, until the small CTAs cost more than they spread (H200,
    H = 8, D = 128, time against 512 threads, cold / hot, tuning-log 118 and 119).

    - k8v4 at E = 8: 128 threads while those CTAs are at most ``sm_count`` (T = 1 0.93 / 0.92,
      16 0.84 / 0.76, 64 0.85 / 0.79, 128 0.89 / 0.85; at T = 256, 256 CTAs: 0.975 / 1.08).
    - The MSE presets at E = 8: 256 threads where that makes more CTAs than 512 would and while
      those are at most ``sm_count`` (T = 16 0.90 / 0.885, 64 0.92 / 0.89; one CTA either way at
      T = 1: 1.045 / 1.03). While each CTA checked the rotation table itself, 128 CTAs at T = 256
      took 1.045 / 1.09 and the limit was 64; with the table checked by :func:`check_ctas`'s
      kernel, up to the SMs: T = 128 0.83 / 0.80, 256 0.905 / 0.85 against 64 (tuning-log 121).
    """
    opts = cta_options(key_bits, elems)
    if len(opts) == 1:
        return opts[0]
    small, large = opts
    ctas = -(-rows // (small // lanes_per_row))
    if key_bits == 8:
        return small if ctas <= sm_count else large
    more = rows > large // lanes_per_row
    return small if more and ctas <= sm_count else large


def row_warps(key_bits: int, elems: int, lanes_per_row: int, rows: int, threads: int,
              sm_count: int, tuning: CudaTuning = TUNING) -> int:
    """The warps of a CTA that take rows, a power of two (the kernel takes its log2): every one,
    but in the MSE presets' small calls (E = 8) the fewest that keep the CTAs at most
    ``sm_count``, at least ``tuning.mse_row_warps``: their rows queue behind each other's
    instructions on a scheduler; the CTA's other warps only share its setup."""
    every = threads // 32
    if key_bits == 8 or elems != 8:
        return every
    need = -(-rows // ((32 // lanes_per_row) * sm_count))
    return min(every, next_pow2(max(tuning.mse_row_warps, need)))


def grid(num_rows: int, head_size: int, resident: int, threads: int,
         tuning: CudaTuning = TUNING, least: int = 2, warps: int | None = None) -> int:
    """CTAs for ``num_rows`` (token, head) rows: the rows' CTAs, at most ``waves`` times the
    ``resident`` CTAs (``threads``: the CTA size, :func:`cta_threads`'s; the emulation's
    differs; ``least``: :func:`min_elems`; ``warps``: those with rows, :func:`row_warps`'s,
    every one by default)."""
    _, lpr = lanes(head_size, tuning, num_rows, least)
    rows_per_cta = (warps or threads // 32) * (32 // lpr)
    return max(1, min(-(-num_rows // rows_per_cta), max(1, resident) * max(1, tuning.waves)))


def all_kernel_names() -> list[str]:
    """Every variant `run` can launch (for compile tests): 3-bit fields need D % 8 == 0, so
    E >= 8 there; then the table check, then the small calls' split kernels."""
    return [kernel_name(kind, kb, vb, sd, e, c) for kind in launch.KIND.values()
            for kb, vb in BITS for sd in (torch.int32, torch.int64) for e in LANE_ELEMS
            if e >= 8 or (kb != 3 and vb != 3) for c in cta_options(kb, e)] + [CHECK_KERNEL] + [
        split_kernel_name(kind, kb, vb, sd, e) for kind in launch.KIND.values()
        for kb, vb in BITS if kb != 8 for sd in (torch.int32, torch.int64) for e in SPLIT_ELEMS]


def check_ctas(key_bits: int, head_size: int, rows: int, tuning: CudaTuning = TUNING,
               threads: int = CHECK_THREADS) -> int:
    """The CTAs of the table check ahead of ``tq_kernel`` (four entries a thread), 0 where
    ``tq_kernel``'s CTAs check the table themselves (calls of more than ``tuning.check_rows``
    rows) or there is nothing to check (k8v4; D not a power of two: the generic rotation)."""
    if key_bits == 8 or head_size & (head_size - 1) or rows > tuning.check_rows:
        return 0
    return -(-head_size * head_size // (4 * threads))


available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(key, kv_cache, preset) -> str | None:
    d = key.shape[2]
    if d > MAX_HEAD_SIZE:
        return (f"head size {d} > {MAX_HEAD_SIZE}: the cuda kernel holds a row in at most 32 "
                f"lanes of 32 elements (torch runs it)")
    return None


LAUNCHES = launch.LaunchCache()
CHECKS = launch.LaunchCache()  # the table check's, by (device index, tuning)


def _loaded(cache: launch.LaunchCache, sig, name: str, index: int, fixed: tuple = (),
            specialize: bool = False) -> launch.Launchable:
    """The variant ``name`` on device ``index``, loaded once under ``sig`` in ``cache``, with
    ``fixed`` compiled in where ``specialize`` (no occupancy bound: the split kernel and the
    table check size their grids from the call)."""
    lau = cache.get(sig)
    if lau is None:
        launch.require_setup()
        k, pk = launch.load(SOURCE, name, fixed, index, specialize)
        lau = cache[sig] = launch.Launchable(k, pk, index, fixed)
    return lau


def _check_table(PiT: torch.Tensor, n: int, index: int, tuning: CudaTuning) -> torch.Tensor:
    """Launch the table check of ``n`` CTAs on PyTorch's current stream: its flags (one int32 a
    CTA)."""
    d = PiT.shape[0]
    flags = torch.empty(n, dtype=torch.int32, device=PiT.device)
    lau = _loaded(CHECKS, (index, tuning), CHECK_KERNEL, index)
    kernel, pdl = lau.pick(n, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(n, 1, CHECK_THREADS, 1, pdl)
    nvrtc.launch(lau.device_index, config, kernel, PiT.data_ptr(), d, *PiT.stride(),
                 flags.data_ptr())
    return flags


def run(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor, preset, PiT: torch.Tensor | None,
        midpoints: torch.Tensor | None, *, tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    h, d = key.shape[1], key.shape[2]
    if d > MAX_HEAD_SIZE:
        raise ValueError("implementation='cuda' cannot run this call: "
                         f"{unsupported(key, kv_cache, preset)}")
    kb, vb = int(preset.key_bits), int(preset.value_bits)
    least = min_elems(preset)
    rows = num_tokens * h
    index = key.get_device()
    se = split_elems(kb, d, rows, tuning)
    if se:
        _run_split(key, value, kv_cache, slot_mapping, preset, PiT, midpoints, rows, se, index,
                   tuning)
        return
    e, lpr = lanes(d, tuning, rows, least)
    sm_count = nvrtc.device_arch(index)[1]
    threads = cta_threads(kb, e, lpr, rows, sm_count)
    mse = bool(preset.mse)
    fixed = fixed_args(key, value, kv_cache, PiT if mse else None, midpoints if mse else None)
    special = specialized(rows, mse, tuning)
    sig = (key.dtype, kb, vb, slot_mapping.dtype, e, threads, index, tuning, fixed, special)
    lau = LAUNCHES.get(sig)
    if lau is None:
        launch.require_setup()
        name = kernel_name(launch.KIND[key.dtype], kb, vb, slot_mapping.dtype, e, threads)
        k, pk = launch.load(SOURCE, name, fixed, index, special)
        with nvrtc.capture_relaxed():
            nvrtc.cuda_core().Device(index).set_current()  # PyTorch's primary context
            per_sm = k.occupancy.max_active_blocks_per_multiprocessor(threads, 0)
        lau = LAUNCHES[sig] = launch.Launchable(k, pk, index, fixed,
                                                bounds=(sm_count * max(1, per_sm),))
    checks = check_ctas(kb, d, rows, tuning)
    flags = _check_table(PiT, checks, index, tuning) if checks else None
    warps = row_warps(kb, e, lpr, rows, threads, sm_count, tuning)
    ctas = grid(rows, d, lau.bounds[0], threads, tuning, least=least, warps=warps)
    kernel, pdl = lau.pick(ctas, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(ctas, 1, threads, 1, pdl)
    nvrtc.launch(lau.device_index, config, kernel,
                 *launch_args(key, value, kv_cache, slot_mapping, preset, PiT, midpoints, warps,
                              flags, lau.fixed))


SPLITS = launch.LaunchCache()


def _run_split(key, value, kv_cache, slot_mapping, preset, PiT, midpoints, rows: int,
               elems: int, index: int, tuning: CudaTuning) -> None:
    kb, vb = int(preset.key_bits), int(preset.value_bits)
    fixed = fixed_args(key, value, kv_cache, PiT, midpoints)
    special = specialized(rows, True, tuning)  # in the signature, as run's
    lau = _loaded(SPLITS, (key.dtype, kb, vb, slot_mapping.dtype, elems, index, tuning, fixed,
                           special),
                  split_kernel_name(launch.KIND[key.dtype], kb, vb, slot_mapping.dtype, elems),
                  index, fixed, special)
    ctas = split_grid(rows, key.shape[2])
    kernel, pdl = lau.pick(ctas, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(ctas, 1, SPLIT_THREADS, 1, pdl)
    nvrtc.launch(lau.device_index, config, kernel,
                 *split_args(key, value, kv_cache, slot_mapping, PiT, midpoints, lau.fixed))


def specialized(rows: int, mse: bool, tuning: CudaTuning = TUNING) -> bool:
    """Whether a call of ``rows`` rows takes the build with its fixed arguments compiled in
    (``tuning.specialize``, and an MSE preset's call (``mse``) or one of at most
    ``tuning.specialize_rows`` rows), else the generic one."""
    return tuning.specialize and (mse or rows <= tuning.specialize_rows)


def fixed_args(key, value, kv_cache, PiT, midpoints) -> tuple[int, ...]:
    """Both kernels' 16 trailing arguments (:data:`FIXED_ARGS`), fixed by the call signature:
    H, D, P; the key's and value's token and head strides (a token stride 0 where the view
    holds one token: never multiplied by more than 0); the cache's block, page and head
    strides, block size, its log2 or -1 and slots; the table's and the midpoints' strides (0
    without tables: k8v4)."""
    h, d = key.shape[1], key.shape[2]
    nb, bs = kv_cache.shape[:2]
    tables = (0, 0, 0) if PiT is None else (*PiT.stride(), midpoints.stride(0))
    return (h, d, next_pow2(d), key.stride(0) if key.shape[0] > 1 else 0, key.stride(1),
            value.stride(0) if value.shape[0] > 1 else 0, value.stride(1),
            *kv_cache.stride()[:3], bs, launch.log2_or_minus_1(bs), nb * bs, *tables)


def split_args(key, value, kv_cache, slot_mapping, PiT, midpoints,
               fixed: tuple | None = None) -> tuple[int, ...]:
    """``tq_split_kernel``'s arguments (six addresses, the tokens, then :func:`fixed_args`'s, or
    ``fixed``: kernel.cu's order); tests launch the SIMT emulation with them."""
    return (key.data_ptr(), value.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr(),
            PiT.data_ptr(), midpoints.data_ptr(), slot_mapping.numel(),
            *(fixed or fixed_args(key, value, kv_cache, PiT, midpoints)))


def launch_args(key, value, kv_cache, slot_mapping, preset, PiT, midpoints, warps: int,
                flags: torch.Tensor | None, fixed: tuple | None = None) -> tuple[int, ...]:
    """The kernel's arguments (seven addresses, the tokens, the log2 of the warps with rows,
    the flags' count, then :func:`fixed_args`'s, or ``fixed``: kernel.cu's order) of a call
    whose CTAs have ``warps`` warps with rows (:func:`row_warps`, a power of two), ``flags`` the
    table check's kernel's (None: the CTAs check the table themselves, or there is no table to
    check); tests launch the SIMT emulation with them."""
    if warps < 1 or warps & (warps - 1):
        raise ValueError(f"warps with rows must be a power of two >= 1, got {warps}")
    mse = bool(preset.mse)
    return (key.data_ptr(), value.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr(),
            PiT.data_ptr() if mse else 0, midpoints.data_ptr() if mse else 0,
            0 if flags is None else flags.data_ptr(), slot_mapping.numel(),
            warps.bit_length() - 1, 0 if flags is None else flags.numel(),
            *(fixed or fixed_args(key, value, kv_cache, PiT if mse else None,
                                  midpoints if mse else None)))
