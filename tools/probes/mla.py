"""``probe mla``: launch-shape variants of concat_and_cache_mla's kernels: µs per call (device
timer, CUDA graph of 20 calls, median) for CudaTuning/TritonTuning variants, per mode, at small
and large T, hot L2 and rotated (input sets past 2x the L2), bfloat16, L=512, P=64, block 64,
2048 blocks; and the copy bandwidth at each call's byte count against the 1 GiB copy's.

    python -m tools.probes mla
"""

from __future__ import annotations

import random

import torch

from kvwrite.bench import timing
from kvwrite.bench.engine import Parser
from kvwrite.ops.concat_and_cache_mla import MlaMode, create_mla_cache, cuda_impl, triton_impl

from . import common

VARIANTS = {
    "cuda default": (cuda_impl.run, cuda_impl.TUNING),
    "cuda threads=128 ds_warps=2": (cuda_impl.run, cuda_impl.CudaTuning(threads=128, ds_warps=2)),
    "cuda ds_warps=8": (cuda_impl.run, cuda_impl.CudaTuning(ds_warps=8)),
    "cuda fp8 32B chunks at every size": (cuda_impl.run, cuda_impl.CudaTuning(small_call_bytes=0)),
    "cuda copy 32B chunks": (cuda_impl.run, cuda_impl.CudaTuning(chunk_bytes_copy=32)),
    "cuda fp8 16B chunks at every size": (cuda_impl.run, cuda_impl.CudaTuning(chunk_bytes_fp8=16)),
    "cuda ds bracket at every size": (cuda_impl.run, cuda_impl.CudaTuning(ds_bracket_bytes=0)),
    "cuda ds quotient at every size": (cuda_impl.run, cuda_impl.CudaTuning(ds_bracket_bytes=2**62)),
    "triton default": (triton_impl.run, triton_impl.TUNING),
    "triton tile 8K": (triton_impl.run, triton_impl.TritonTuning(tile_bytes=8192)),
    "triton tile 2K": (triton_impl.run, triton_impl.TritonTuning(tile_bytes=2048)),
    "triton ds tile 4K": (triton_impl.run, triton_impl.TritonTuning(tile_bytes_ds=4096)),
}


def main(argv: list[str], prog: str) -> int:
    Parser(prog=prog, description=__doc__.splitlines()[0]).parse_args(argv)
    common.require_gpu()
    dev = torch.device("cuda")
    # The copy ceiling at each call's size: a device-to-device copy of half its bytes (so bytes
    # read + written equal the call's) against the 1 GiB copy of the benchmark; eager (median of
    # 10, its launch inside the events) and under the benchmark's own timer (20 copies in one
    # CUDA graph, sources and destinations rotated past 2x the L2, median per copy).
    big = timing.copy_bandwidth(dev, 2**30)
    l2 = timing.l2_bytes(dev)
    for T in (16384, 32768, 65536):
        for name, per_token in (("auto", 2304 + 8), ("fp8", 1728 + 8), ("fp8_ds_mla", 1808 + 8)):
            half = T * per_token // 2
            bw = timing.copy_bandwidth(dev, half)
            gbw = timing.graph_copy_bandwidth(dev, half, rotate_bytes=2 * l2)
            print(f"copy of {half / 2**20:.1f} MiB ({name} T={T}): eager {bw / 1e9:.0f} GB/s "
                  f"= {100 * bw / big:.1f}%, in a graph (rotated) {gbw / 1e9:.0f} GB/s = "
                  f"{100 * gbw / big:.1f}% of the 1 GiB copy's {big / 1e9:.0f} GB/s", flush=True)
    for mode in (MlaMode.AUTO, MlaMode.FP8_E4M3, MlaMode.FP8_DS_MLA):
        cache = create_mla_cache(2048, 64, 512, 64, mode, torch.bfloat16, dev)
        scale = torch.tensor([0.1], device=dev) if mode.uses_scale else None
        for T in (16, 16384, 65536):
            n = max(1, min(20, -(-2 * l2 // (T * 1160))))
            sets = []
            for _ in range(n):
                kv_c = torch.randn(T, 512, dtype=torch.bfloat16, device=dev)
                k_pe = torch.randn(T, 64, dtype=torch.bfloat16, device=dev)
                slots = torch.tensor(random.sample(range(2048 * 64), T), device=dev)
                sets.append((kv_c, k_pe, slots))
            flush = torch.empty(2 * l2, dtype=torch.uint8, device=dev) if n * T * 1160 < 2 * l2 else None
            for name, (run, tuning) in VARIANTS.items():
                out = []
                for hot in (True, False):
                    use = sets[:1] if hot else sets

                    def call(i, run=run, tuning=tuning, use=use, cache=cache, mode=mode, scale=scale):
                        a = use[i % len(use)]
                        run(a[0], a[1], cache, a[2], mode, scale, tuning=tuning)

                    t = timing.time_device(call, 20, 50, graph=True,
                                           flush=None if hot else flush, budget_s=0.1)
                    out.append(t.median * 1e6)
                print(f"{mode.value:10s} T={T:6d} {name:32s} hot {out[0]:8.3f} us  rotated "
                      f"{out[1]:8.3f} us", flush=True)
    return 0
