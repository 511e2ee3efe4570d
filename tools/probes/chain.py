"""``probe chain``: the floor of a small call's dependent loads, hot and cold.

Times (the benchmarks' timer: ``CALLS`` calls in one CUDA graph, CUDA events, median per call)
four one-CTA kernels of ``kernels.cu``: an empty launch, a slot's load followed by a store at
that slot's row (``kvw_slot_store``: a cache write's chain), a position's load, then the table
row it selects, then stores (``kvw_rope_chain``: a RoPE write's chain, two dependent loads, 4
bytes per thread), and the same with the whole 512-byte float32 row read in 16-byte pieces as
the RoPE kernels read it (``kvw_rope_row_chain``, 32 threads). Hot: the same position and slot
every call. Cold: ``--sets`` different positions and slots (each on its own 128-byte line) in a
32 MiB table and cache, and the L2 flushed before each timed run (as the rope benchmark does for
small calls), so each call waits for DRAM. No kernel that must read a position and then its table row can be faster than
``kvw_rope_chain`` under the same condition.
Each is timed with plain launches and, where the GPU takes it (compute capability 9.0), with
programmatic dependent launch as the ops launch (the PDL build, which triggers the next call and
then waits for the one before it; launch column ``pdl``).

    python -m tools.probes chain [--sets 20] [--replays 30]
"""

from __future__ import annotations

import torch

from kvwrite.bench import timing
from kvwrite.bench.engine import Parser

from . import common

ROW = 128  # floats per table and cache row (one thread each)
ROWS = 65536  # 32 MiB of table, 32 MiB of cache
LINE = 16  # int64s per position and slot row: one 128-byte line each


def main(argv: list[str], prog: str) -> int:
    p = Parser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--sets", type=int, default=common.CALLS,
                   help=f"positions/slots rotated when cold, at most the {common.CALLS} calls of "
                        f"one graph (call i takes set i %% sets) (default: {common.CALLS})")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays (default: 30)")
    args = p.parse_args(argv)
    if not 1 <= args.sets <= common.CALLS:
        raise common.ProbeError(f"--sets: expected 1 to {common.CALLS} (a graph's calls: call i "
                                f"takes set i % sets, so more are never used), got {args.sets}")
    if args.replays < 1:
        raise common.ProbeError(f"--replays: expected a positive integer, got {args.replays}")
    common.require_gpu()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    table = torch.randn(ROWS, ROW, device=dev, generator=gen)
    cache = torch.zeros(ROWS, ROW, device=dev)
    out = torch.zeros(ROW, device=dev)
    # One 128-byte line per set (the first of 16 int64s): each cold call's position and slot
    # come from DRAM, as the rope benchmark's (one tensor per set). With the sets' values packed
    # into one line, every call after the first found them in the L2 and the cold chain read
    # 1.06-1.10 us with PDL instead of 1.25 (tuning-log change 48).
    positions = torch.randint(0, ROWS, (args.sets, LINE), device=dev, generator=gen)
    slots = torch.randint(0, ROWS, (args.sets, LINE), device=dev, generator=gen)
    flush = torch.empty(2 * timing.l2_bytes(dev), dtype=torch.uint8, device=dev)
    index = torch.cuda.current_device()
    launches = ["plain"] + (["pdl"] if common.nvrtc.pdl_capable(index) else [])

    def calls(n: int, launch: str) -> dict:
        pdl = launch == "pdl"
        empty, slot_store, rope_chain, row_chain = (common.kernel(name, pdl) for name in (
            "kvw_empty", "kvw_slot_store", "kvw_rope_chain", "kvw_rope_row_chain"))
        return {
            "empty kernel": lambda i: common.launch(empty, (1, 1), 1, pdl=pdl)(),
            "slot -> store": lambda i: common.launch(
                slot_store, (1, 1), ROW, slots[i % n].data_ptr(), cache.data_ptr(), ROW,
                pdl=pdl)(),
            "position -> table row -> store": lambda i: common.launch(
                rope_chain, (1, 1), ROW, positions[i % n].data_ptr(), table.data_ptr(),
                slots[i % n].data_ptr(), out.data_ptr(), cache.data_ptr(), ROW, pdl=pdl)(),
            "position -> 16 B pieces of the row -> store": lambda i: common.launch(
                row_chain, (1, 1), ROW // 4, positions[i % n].data_ptr(), table.data_ptr(),
                slots[i % n].data_ptr(), out.data_ptr(), cache.data_ptr(), ROW // 4, pdl=pdl)(),
        }

    print(f"# {torch.cuda.get_device_name()}: us per call, median of {args.replays} replays of "
          f"{common.CALLS} calls in one CUDA graph; launch plain or pdl (programmatic dependent "
          "launch)", flush=True)
    for hot in (True, False):
        for launch in launches:
            for name, call in calls(1 if hot else args.sets, launch).items():
                t = timing.time_device(call, common.CALLS, args.replays, graph=True,
                                       flush=None if hot else flush)
                print(f"{'hot ' if hot else 'cold'}  {launch:5s}  {name:43s} "
                      f"{t.median * 1e6:7.3f}", flush=True)
    return 0
