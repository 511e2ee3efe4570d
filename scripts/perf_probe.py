"""Tuning probe: time implementations (and variants of their tuning knobs) at the points of the
performance issue, in one process, against the copy bandwidth measured in the same run.

Method (the one the quoted vLLM figures use): 20 calls captured in one CUDA graph, CUDA events
around each replay, median over replays, per call = replay / 20; hot L2 (the same inputs every
call). This is a development tool; the user-facing benchmark is ``kvwrite-bench``.

    python scripts/perf_probe.py --impls triton,cuda --set triton._TILE_BYTES=16384

Besides the implementations, ``--impls`` takes ``pattern``: a minimal NVRTC kernel that moves
the same bytes to the same cache addresses with none of the op's work (fp8: each bfloat16's high
byte instead of the quotient), i.e. what this access pattern costs on this GPU
(``pattern_el``: the same with evict-last loads).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics

import torch

import kvwrite
from kvwrite.dtypes import parse_kv_cache_dtype
from kvwrite.layouts import KVAlloc, Layout, allocate_kv_cache

CALLS = 20


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(22):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * nbytes / statistics.median(times[2:])


def time_graph(fn, replays: int) -> float:
    """Median seconds per call of `fn` captured CALLS times in one graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / CALLS)
    return statistics.median(times)


def empty_kernel_floor() -> float:
    """An empty kernel (NVRTC, one thread) launched the way the cuda implementation launches."""
    from kvwrite.ops.reshape_and_cache_flash import cuda_impl as ci

    arch, _ = ci._device_arch(torch.cuda.current_device())
    obj, _ = ci.compile_kernel(arch, "kvwrite_empty",
                               source='extern "C" __global__ void kvwrite_empty() {}')
    kernel = obj.get_kernel("kvwrite_empty")
    cc = ci._cuda_core()
    config = cc.LaunchConfig(grid=(1, 1, 1), block=(1, 1, 1))
    cc.Device(torch.cuda.current_device()).set_current()
    return time_graph(lambda: cc.launch(ci._current_stream(torch.cuda.current_device()),
                                        config, kernel), 50)


def empty_triton_floor() -> float | None:
    """An empty Triton kernel (one program, one warp), for comparison with the NVRTC floor."""
    try:
        import triton
    except ImportError:
        return None

    @triton.jit
    def _empty(x):
        pass

    x = torch.empty(1, device="cuda")
    return time_graph(lambda: _empty[(1,)](x, num_warps=1), 50)


_PATTERN_SRC = r"""
// The bytes and addresses of one call, without the op's work: each thread reads one 32-byte
// (fp8) or 16-byte (copy) chunk of K and of V and writes 16 bytes of each (fp8: the high byte of
// each bfloat16, no quotient) at the cache address of its token's slot.
__device__ __forceinline__ uint4 ld(const unsigned char* p) {
#ifdef EVICT_LAST
  uint4 v;
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}
extern "C" __global__ void kvw_pattern(const unsigned char* __restrict__ key,
    const unsigned char* __restrict__ value, unsigned char* kc, unsigned char* vc,
    const long long* __restrict__ slots, long long row_in_bytes, unsigned chunks, unsigned cph,
    long long sb, long long ss, long long sh, int fp8) {
  const long long t = blockIdx.x;
  const unsigned c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= chunks) return;
  const long long s = slots[t];
  const unsigned in_chunk = fp8 ? 32 : 16;
  const unsigned char* kp = key + t * row_in_bytes + (long long)c * in_chunk;
  const unsigned char* vp = value + t * row_in_bytes + (long long)c * in_chunk;
  const unsigned h = c / cph, d = (c - h * cph) * 16;
  const long long off = (s >> 4) * sb + (s & 15) * ss + (long long)h * sh + d;
  uint4 k = ld(kp), v = ld(vp);
  if (fp8) {
    const uint4 k1 = ld(kp + 16), v1 = ld(vp + 16);
    k = make_uint4(__byte_perm(k.x, k.y, 0x7531), __byte_perm(k.z, k.w, 0x7531),
                   __byte_perm(k1.x, k1.y, 0x7531), __byte_perm(k1.z, k1.w, 0x7531));
    v = make_uint4(__byte_perm(v.x, v.y, 0x7531), __byte_perm(v.z, v.w, 0x7531),
                   __byte_perm(v1.x, v1.y, 0x7531), __byte_perm(v1.z, v1.w, 0x7531));
  }
  *reinterpret_cast<uint4*>(kc + off) = k;
  *reinterpret_cast<uint4*>(vc + off) = v;
}
"""


@functools.cache
def _pattern_kernel(evict_last: bool):
    from kvwrite.ops.reshape_and_cache_flash import cuda_impl as ci

    arch, _ = ci._device_arch(torch.cuda.current_device())
    src = ("#define EVICT_LAST\n" if evict_last else "") + _PATTERN_SRC
    obj, _ = ci.compile_kernel(arch, "kvw_pattern", source=src)
    return obj.get_kernel("kvw_pattern")


def pattern_call(key, value, kc, vc, slots, fp8: bool, evict_last: bool = False):
    """A call of the minimal kernel above on these tensors (block size 16, D a multiple of 16)."""
    from kvwrite.ops.reshape_and_cache_flash import cuda_impl as ci

    kernel = _pattern_kernel(evict_last)
    cc = ci._cuda_core()
    t, h, d = key.shape
    out_chunk_elems = 16 // kc.element_size()
    chunks, cph = h * d // out_chunk_elems, d // out_chunk_elems
    threads = min(256, chunks)
    config = cc.LaunchConfig(grid=(t, -(-chunks // threads), 1), block=(threads, 1, 1))
    sb, ss, sh = (x * kc.element_size() for x in kc.stride()[:3])
    args = (key.data_ptr(), value.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr(),
            key.stride(0) * key.element_size(), chunks, cph, sb, ss, sh, int(fp8))
    dev = torch.cuda.current_device()
    return lambda: cc.launch(ci._current_stream(dev), config, kernel, *args)


def point_inputs(t: int, h: int, d: int, num_slots: int, seed: int = 0,
                 scale: float | None = None):
    """(key, value, slots, k_scale, v_scale) of one point: random bfloat16 [T, H, D] rows, T
    unique random slots below num_slots, per-tensor scales amax / 64 (or ``scale``)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    key = torch.randn(t, h, d, dtype=torch.bfloat16, device="cuda", generator=g)
    value = torch.randn(t, h, d, dtype=torch.bfloat16, device="cuda", generator=g)
    slots = torch.randperm(num_slots, device="cuda", generator=g)[:t]
    if scale is None:
        ks = (key.amax() / 64).float().reshape(1)
        vs = (value.amax() / 64).float().reshape(1)
    else:
        ks = torch.full((1,), scale, device="cuda")
        vs = torch.full((1,), scale, device="cuda")
    return key, value, slots, ks, vs


def op_call(impl: str, key, value, kc, vc, slots, kv: str, ks, vs):
    """The public op on these tensors with one implementation, as a callable for time_graph."""
    return lambda: kvwrite.reshape_and_cache_flash(key, value, kc, vc, slots, kv, ks, vs,
                                                   implementation=impl)


def parse_variants(sets: list[str]) -> list[list[tuple[str, str]]]:
    """``--set`` options (``module.ATTR=v1|v2``) -> every combination of their alternatives, each
    a list of (module.ATTR, value expression)."""
    variants: list[list[tuple[str, str]]] = [[]]
    for s in sets:
        target, vals = s.split("=", 1)
        variants = [v + [(target, alt)] for v in variants for alt in vals.split("|")]
    return variants


def apply_variant(variant: list[tuple[str, str]]) -> None:
    """Set each kvwrite.impls.<module>_impl.ATTR (converted to the type it had) and drop what
    caches it: lru caches and the cuda implementation's launchables."""
    for target, val in variant:
        mod, attr = target.split(".")
        m = importlib.import_module(f"kvwrite.impls.{mod}_impl")
        setattr(m, attr, type(getattr(m, attr))(eval(val)))
        for f in vars(m).values():
            if hasattr(f, "cache_clear"):
                f.cache_clear()
        getattr(m, "_LAUNCHABLES", {}).clear()


def variant_label(variant: list[tuple[str, str]]) -> str:
    return ",".join(f"{target}={val}" for target, val in variant)


POINTS = [  # (H, D, layout, alloc, kv, T)
    *[(128, 128, lo, al, kv, t) for lo, al in ((Layout.NHD, KVAlloc.INTERLEAVED),
                                               (Layout.HND, KVAlloc.INTERLEAVED),
                                               (Layout.NHD, KVAlloc.PACKED))
      for kv in ("auto", "fp8") for t in (2, 4, 1024, 4096, 16384, 65536)],
    *[(8, 128, lo, al, kv, t) for lo, al in ((Layout.NHD, KVAlloc.INTERLEAVED),
                                             (Layout.HND, KVAlloc.INTERLEAVED),
                                             (Layout.NHD, KVAlloc.PACKED))
      for kv in ("auto", "fp8") for t in (2, 64, 1024, 32768, 65536)],
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="triton,cuda", help="also pattern, pattern_el (see above)")
    ap.add_argument("--set", action="append", default=[],
                    help="module.ATTR=value tuning override, e.g. triton._TILE_BYTES=16384; "
                         "alternatives separated by '|' (triton._TILE_BYTES=4096|8192) make variants")
    ap.add_argument("--filter", default="",
                    help="only points whose label (H-D-layout-alloc-kv-T) contains one of these "
                         "comma-separated strings")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--tokens", default="",
                    help="comma-separated token counts to use instead of the issue's points")
    ap.add_argument("--blocks", type=int, default=8192,
                    help="cache blocks of 16 slots (kvwrite-bench's default: 65536)")
    ap.add_argument("--scale", type=float, default=None,
                    help="fp8 scale for K and V (default: amax / 64, as the benchmark)")
    args = ap.parse_args()

    variants = parse_variants(args.set)
    bw = copy_bandwidth()
    floor = empty_kernel_floor()
    tfloor = empty_triton_floor()
    print(f"# {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s (read+write)  "
          f"empty-kernel floor {floor * 1e6:.2f} us/call (graph; NVRTC), "
          f"{tfloor * 1e6 if tfloor else float('nan'):.2f} (Triton)")
    dtype = torch.bfloat16
    caches = {}
    for impl in args.impls.split(","):
        for variant in variants:
            apply_variant(variant)
            tag = impl + (f"[{variant_label(variant)}]" if variant else "")
            print(f"\n## {tag}")
            print(f"{'H':>4} {'D':>4} {'layout':>7} {'kv':>5} {'T':>6} {'us':>9} {'%bw':>6}")
            points = POINTS
            if args.tokens:
                shapes = dict.fromkeys(p[:5] for p in POINTS)
                points = [(*sh, int(t)) for sh in shapes for t in args.tokens.split(",")]
            for h, d, layout, alloc, kv, t in points:
                label = f"{h}-{d}-{layout.value}-{alloc.value}-{kv}-{t}"
                if args.filter and not any(f in label for f in args.filter.split(",")):
                    continue
                cdt = parse_kv_cache_dtype(kv)
                cache_dtype = torch.uint8 if cdt.is_fp8 else dtype
                key_ = (h, d, layout, alloc, cache_dtype)
                if key_ not in caches:
                    caches.clear()
                    torch.cuda.empty_cache()
                    caches[key_] = allocate_kv_cache(args.blocks, 16, h, d, cache_dtype,
                                                     layout, alloc, "cuda")
                kc, vc = caches[key_]
                key, value, slots, ks, vs = point_inputs(t, h, d, kc.shape[0] * 16,
                                                         scale=args.scale)
                if impl in ("pattern", "pattern_el"):
                    call = pattern_call(key, value, kc, vc, slots, cdt.is_fp8,
                                        impl == "pattern_el")
                else:
                    call = op_call(impl, key, value, kc, vc, slots, kv, ks, vs)

                sec = time_graph(call, args.replays)
                nbytes = 2 * t * h * d * (2 + cdt.element_size(dtype)) + t * 8
                print(f"{h:>4} {d:>4} {layout.value + ('/p' if alloc is KVAlloc.PACKED else ''):>7} "
                      f"{kv:>5} {t:>6} {sec * 1e6:>9.2f} {100 * nbytes / sec / bw:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
