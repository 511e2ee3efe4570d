"""``probe mla-pattern``: what the slot pattern and the entry alignment cost concat_and_cache_mla
at large T.

The same kernels (``cuda``, ``triton``; default tunings), the same bytes, only the addresses
change: ``random`` slots (vLLM's benchmark: unique slots drawn uniformly, so consecutive tokens
land in unrelated blocks), the same slots ``sorted`` (each block's rows written by neighbouring
CTAs, the writes still sparse over the cache), and ``consecutive`` slots (a prefill: rows one
after another from a block boundary, the writes one contiguous stream). Each with the natural
entry (1152 / 576 / 656 bytes for auto / fp8 / fp8_ds_mla) and with the entry's stride padded
to a multiple of 128 bytes (a view of a wider cache), which tells whether entries that share a
128-byte line (576 and 656 do; 656 also shares 32-byte sectors) cost more than the bytes.
For auto, PyTorch's ``index_copy_`` of the same rows (concatenated beforehand) into the same
slots is timed too: another kernel's scatter of the same bytes. Inputs rotate past twice the L2
(20 calls per CUDA graph, median per call); % is of the 1 GiB copy's bandwidth, the bytes
counted as the benchmark counts them.

    python -m tools.probes mla-pattern [--tokens 16384,65536] [--modes auto,fp8,fp8_ds_mla]
"""

from __future__ import annotations

import random

import torch

from kvwrite.bench import timing
from kvwrite.bench.engine import Parser
from kvwrite.ops.concat_and_cache_mla import MlaMode, cuda_impl, parse_mla_mode, triton_impl
from kvwrite.ops.concat_and_cache_mla.op import entry_size

from . import common

L, P, BLOCK, BLOCKS = 512, 64, 64, 2048
PATTERNS = ("random", "sorted", "consecutive")
RUNS = {"cuda": cuda_impl.run, "triton": triton_impl.run}


def slots_for(pattern: str, num_tokens: int, rng: random.Random) -> list[int]:
    """``num_tokens`` unique slots of a ``BLOCKS x BLOCK`` cache in ``pattern``'s order."""
    num_slots = BLOCKS * BLOCK
    if pattern == "consecutive":
        start = BLOCK * rng.randrange((num_slots - num_tokens) // BLOCK + 1)
        return list(range(start, start + num_tokens))
    s = rng.sample(range(num_slots), num_tokens)
    return sorted(s) if pattern == "sorted" else s


def padded_cache(mode: MlaMode, pad_to: int, device: torch.device) -> torch.Tensor:
    """A zeroed ``[BLOCKS, BLOCK, E]`` cache whose entry stride (in bytes) is the entry rounded
    up to ``pad_to`` bytes (1: contiguous)."""
    e = entry_size(mode, L, P)
    dtype = torch.bfloat16 if mode is MlaMode.AUTO else torch.uint8
    eb = e * dtype.itemsize
    stride = -(-eb // pad_to) * pad_to // dtype.itemsize
    return torch.zeros(BLOCKS, BLOCK, stride, dtype=dtype, device=device)[..., :e]


def main(argv: list[str], prog: str) -> int:
    p = Parser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16384,65536", help="comma list (default: 16384,65536)")
    p.add_argument("--modes", default="auto,fp8,fp8_ds_mla",
                   help="comma list of kv_cache_dtype values (default: auto,fp8,fp8_ds_mla)")
    p.add_argument("--impls", default="cuda,triton", help="comma list (default: cuda,triton)")
    args = p.parse_args(argv)
    tokens = common.int_list("--tokens", args.tokens)
    modes = [parse_mla_mode(m) for m in args.modes.split(",") if m.strip()]
    impls = common.str_list("--impls", args.impls, tuple(RUNS))
    if max(tokens) > BLOCKS * BLOCK:
        raise common.ProbeError(f"--tokens: at most {BLOCKS * BLOCK}, got {max(tokens)}")
    common.require_gpu()
    dev = torch.device("cuda")
    big = timing.copy_bandwidth(dev, 2**30)
    l2 = timing.l2_bytes(dev)
    print(f"# {torch.cuda.get_device_name()}: 1 GiB copy {big / 1e9:.0f} GB/s; bfloat16, L={L}, "
          f"P={P}, block {BLOCK}, {BLOCKS} blocks; rotated L2; us per call (% of copy bandwidth)",
          flush=True)
    for mode in modes:
        scale = torch.tensor([0.1], device=dev) if mode.uses_scale else None
        caches = {"natural": padded_cache(mode, 1, dev), "128B": padded_cache(mode, 128, dev)}
        e_bytes = caches["natural"].shape[-1] * caches["natural"].element_size()
        if e_bytes % 128 == 0:
            del caches["128B"]  # the same addresses
        for T in tokens:
            per_set = T * (L + P) * 2 + T * 8
            n, flush = timing.l2_rotation(False, per_set, l2, 20)
            flush_buf = torch.empty(2 * l2, dtype=torch.uint8, device=dev) if flush else None
            nbytes = per_set + T * e_bytes
            rng = random.Random(42)
            inputs = [(torch.randn(T, L, dtype=torch.bfloat16, device=dev),
                       torch.randn(T, P, dtype=torch.bfloat16, device=dev)) for _ in range(n)]
            for pattern in PATTERNS:
                slots = [torch.tensor(slots_for(pattern, T, rng), device=dev) for _ in range(n)]
                cells = []
                for cname, cache in caches.items():
                    for impl in impls:
                        def call(i, run=RUNS[impl], cache=cache, inputs=inputs, slots=slots,
                                 mode=mode, scale=scale):
                            kv_c, k_pe = inputs[i % len(inputs)]
                            run(kv_c, k_pe, cache, slots[i % len(slots)], mode, scale)

                        t = timing.time_device(call, common.CALLS, 50, graph=True,
                                               flush=flush_buf, budget_s=0.15).median
                        cells.append(f"{cname} {impl} {t * 1e6:7.2f} "
                                     f"({100 * nbytes / t / big:4.1f}%)")
                if mode is MlaMode.AUTO:
                    # Another scatter of the same bytes: PyTorch's index_copy_ of the rows
                    # concatenated beforehand (not an implementation of the op).
                    rows = [torch.cat([kv_c, k_pe], 1) for kv_c, k_pe in inputs]
                    flat = caches["natural"].view(-1, L + P)

                    def scatter(i, rows=rows, slots=slots, flat=flat):
                        flat.index_copy_(0, slots[i % len(slots)], rows[i % len(rows)])

                    t = timing.time_device(scatter, common.CALLS, 50, graph=True,
                                           flush=flush_buf, budget_s=0.15).median
                    cells.append(f"torch index_copy_ {t * 1e6:7.2f} ({100 * nbytes / t / big:4.1f}%)")
                print(f"{mode.value:10s} T={T:6d} {pattern:11s} " + "  ".join(cells), flush=True)
        del caches
        torch.cuda.empty_cache()
    return 0
