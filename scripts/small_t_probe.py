"""Small-T probe: where a latency-bound call's time goes.

Times, at small token counts and in one process, the two implementations next to minimal NVRTC
kernels that do only the unavoidable work (one slot load per thread, one 16-byte load of K and of
V, one store of each; for fp8 also the scale's load and the division-free quotient), on the same
caches and the same slots. Cache layouts: NHD, HND, and HND with its head stride padded by
``--pad`` elements (the same work at addresses that are not 4 KiB apart), to separate what the
kernels do from what the addresses cost. Each figure is the mean over ``--seeds`` slot sets of
the per-call time (20 calls in one CUDA graph, CUDA events, median of replays; hot L2), because
at these sizes the slots' addresses alone move a call by ~0.1-0.2 us.

    PYTHONPATH=src python scripts/small_t_probe.py --heads 8,128 --tokens 2,64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from kvwrite.ops.reshape_and_cache_flash import cuda_impl as ci

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The same timer (20 calls in one CUDA graph), inputs and --set overrides as perf_probe.py.
from perf_probe import (  # noqa: E402
    apply_variant,
    op_call,
    parse_variants,
    point_inputs,
    time_graph,
    variant_label,
)

D = 128  # head size (bfloat16 input)
BS = 16  # block size

# Minimal kernels appended to the package's kernel source (for make_fp8_scale, fp8_quantize).
# One thread per 16-byte chunk of a token's K row (and the same chunk of V): slot load, data
# loads, store through (block, page, head) strides. H and the strides are template constants,
# so the kernel reads nothing but its pointers and T from the parameter bank.
PROBE_SOURCE = r"""
template <int H, int FP8, long long PAGE, long long HEAD, long long BLOCK>
__global__ void __launch_bounds__(128) kvw_probe(
    const u8* __restrict__ key, const u8* __restrict__ value, u8* __restrict__ kc,
    u8* __restrict__ vc, const long long* __restrict__ slots, const float* __restrict__ ks,
    const float* __restrict__ vs, long long T) {
  const u32 g = blockIdx.x * blockDim.x + threadIdx.x;
  constexpr u32 C = H * 16;  // 16-byte chunks per token row
  const u32 t = g / C;
  if (t >= T) return;
  const u32 c = g % C;
  const long long s = slots[t];
  float k_s = 0.f, v_s = 0.f;
  if (FP8) { k_s = ks[0]; v_s = vs[0]; }
  const uint4 kk = reinterpret_cast<const uint4*>(key)[g];
  const uint4 vv = reinterpret_cast<const uint4*>(value)[g];
  const u32 h = c >> 4, d = (c & 15) * 8;
  const long long off = (s >> 4) * BLOCK + (s & 15) * PAGE + h * HEAD + d;  // elements
  if (!FP8) {
    reinterpret_cast<uint4*>(kc + off * 2)[0] = kk;
    reinterpret_cast<uint4*>(vc + off * 2)[0] = vv;
  } else {
    const Fp8Scale ksc = make_fp8_scale(k_s), vsc = make_fp8_scale(v_s);
    float xk[8], xv[8];
    const u32 wk[4] = {kk.x, kk.y, kk.z, kk.w}, wv[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      xk[i] = bits_f32((wk[i >> 1] >> ((i & 1) * 16)) << 16);
      xv[i] = bits_f32((wv[i >> 1] >> ((i & 1) * 16)) << 16);
    }
    u32 ok[2], ov[2];
    fp8_quantize<DT_E4M3, 8, 1>(xk, ok, ksc);
    fp8_quantize<DT_E4M3, 8, 1>(xv, ov, vsc);
    reinterpret_cast<uint2*>(kc + off)[0] = make_uint2(ok[0], ok[1]);
    reinterpret_cast<uint2*>(vc + off)[0] = make_uint2(ov[0], ov[1]);
  }
}
"""


def strides(layout: str, h: int, pad: int) -> tuple[int, int, int]:
    """(block, page, head) strides in elements of one cache (K and V blocks interleaved)."""
    if layout == "NHD":
        return 2 * BS * h * D, h * D, D
    head = BS * D + (pad if layout == "HNDpad" else 0)
    return 2 * h * head, D, head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="8,128")
    ap.add_argument("--tokens", default="2")
    ap.add_argument("--layouts", default="NHD,HND,HNDpad")
    ap.add_argument("--kv", default="auto,fp8")
    ap.add_argument("--pad", type=int, default=64, help="extra head stride of HNDpad (elements)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--impls", default="cuda,triton")
    ap.add_argument("--set", action="append", default=[],
                    help="module.ATTR=v1|v2 tuning overrides (as perf_probe.py): one row each")
    args = ap.parse_args()
    variants = parse_variants(args.set)
    impls = args.impls.split(",")

    dev = torch.cuda.current_device()
    arch, _ = ci._device_arch(dev)
    cc = ci._cuda_core()
    cc.Device(dev).set_current()
    heads = [int(x) for x in args.heads.split(",")]
    layouts = args.layouts.split(",")
    names = {}
    for h in heads:
        for lo in layouts:
            b, p, hs = strides(lo, h, args.pad)
            for fp8 in (0, 1):
                names[(h, lo, fp8)] = f"kvw_probe<{h}, {fp8}, {p}LL, {hs}LL, {b}LL>"
    obj, _ = ci.compile_kernel(arch, list(names.values()),
                               source=ci.kernel_source() + PROBE_SOURCE)
    empty_obj, _ = ci.compile_kernel(arch, "kvw_empty",
                                     source='extern "C" __global__ void kvw_empty() {}')
    empty = empty_obj.get_kernel("kvw_empty")
    one = cc.LaunchConfig(grid=(1, 1, 1), block=(1, 1, 1))
    floor = time_graph(lambda: cc.launch(ci._current_stream(dev), one, empty), 50)
    print(f"# {torch.cuda.get_device_name()}  empty kernel {floor * 1e6:.2f} us/call; "
          f"mean over {args.seeds} slot sets, us/call (hot L2)")
    print(f"{'H':>4} {'T':>4} {'layout':>7} {'kv':>5} {'min':>7} {'cuda':>7} {'triton':>7}  variant")
    for h in heads:
        for lo in layouts:
            b, p, hs = strides(lo, h, args.pad)
            n_el = args.blocks * b
            kv_bf16 = torch.empty(n_el, dtype=torch.bfloat16, device="cuda")
            kv_u8 = torch.empty(n_el, dtype=torch.uint8, device="cuda")
            shape = (args.blocks, BS, h, D)
            st = (b, p, hs, 1)
            caches = {
                "auto": (kv_bf16.as_strided(shape, st), kv_bf16.as_strided(shape, st, b // 2)),
                "fp8": (kv_u8.as_strided(shape, st), kv_u8.as_strided(shape, st, b // 2)),
            }
            for t in (int(x) for x in args.tokens.split(",")):
                for kv in args.kv.split(","):
                    kc, vc = caches[kv]
                    fp8 = int(kv == "fp8")
                    kern = obj.get_kernel(names[(h, lo, fp8)])
                    threads = t * h * 16
                    cfg = cc.LaunchConfig(grid=(-(-threads // 128), 1, 1), block=(128, 1, 1))
                    res = {"min": [], **{(i, k): [] for i in range(len(variants))
                                         for k in ("cuda", "triton")}}
                    for seed in range(args.seeds):
                        key, value, slots, ks, vs = point_inputs(t, h, D, args.blocks * BS,
                                                                 seed=seed)
                        kcp, vcp = kc.data_ptr(), vc.data_ptr()

                        def run_min(key=key, value=value, slots=slots, ks=ks, vs=vs,
                                    kern=kern, cfg=cfg, kcp=kcp, vcp=vcp, t=t):
                            cc.launch(ci._current_stream(dev), cfg, kern, key.data_ptr(),
                                      value.data_ptr(), kcp, vcp, slots.data_ptr(),
                                      ks.data_ptr(), vs.data_ptr(), t)

                        res["min"].append(time_graph(run_min, args.replays))
                        for i, variant in enumerate(variants):
                            apply_variant(variant)
                            for impl in impls:
                                call = op_call(impl, key, value, kc, vc, slots, kv, ks, vs)
                                res[(i, impl)].append(time_graph(call, args.replays))
                        if seed == 0:  # the minimal kernel writes what the op writes
                            blk, pg = slots // BS, slots % BS
                            want = (kc[blk, pg].clone(), vc[blk, pg].clone())
                            kc[blk, pg] = 0
                            vc[blk, pg] = 0
                            run_min()
                            if not (torch.equal(kc[blk, pg], want[0])
                                    and torch.equal(vc[blk, pg], want[1])):
                                raise SystemExit(f"minimal kernel wrote other bytes: {h} {lo} {kv}")
                    for i, variant in enumerate(variants):
                        cols = [statistics.mean(res["min"])] + [
                            statistics.mean(res[(i, k)]) if res[(i, k)] else float("nan")
                            for k in ("cuda", "triton")]
                        print(f"{h:>4} {t:>4} {lo:>7} {kv:>5} "
                              + " ".join(f"{c * 1e6:>7.3f}" for c in cols)
                              + "  " + variant_label(variant), flush=True)
            del caches, kv_bf16, kv_u8
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
