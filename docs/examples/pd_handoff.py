"""Hand cache blocks from a prefill rank to decode ranks through transfer pages, between two
processes, with torch.distributed as the transport (no transport of kvwrite's own).

TP = 1 -> TP = 2: rank 0 holds every head and packs three blocks of every layer into pages
(``pack_kv_pages``); a page keeps heads outermost, so rank 1's heads are one contiguous byte range
of each page row: rank 0 sends only that range (``dist.send``), and each rank unpacks its heads
(``unpack_kv_pages`` with ``head_range``) into a cache of its own stride order. TP = 2 -> TP = 1:
each rank packs its heads, rank 1 sends its pages, rank 0 unpacks both into one cache. For raw,
fp8 and nvfp4 pages and two pairs of vLLM's stride orders; every destination byte is checked (raw:
the source's bits; fp8, nvfp4: the reads of the quantized pages). The code is
src/kvwrite/testing/handoff.py (tests/test_distributed.py runs it too); see docs/ops/transfer.md.

    python docs/examples/pd_handoff.py                           # spawns its 2 ranks
    torchrun --nproc-per-node 2 docs/examples/pd_handoff.py      # or torchrun's 2 ranks

With 2 GPUs or more: NCCL, rank r on cuda:r. With fewer: gloo on host tensors (the torch
implementation), and the line it prints says so. Prints one line and exits 0 when every check
passed.
"""

import os

import torch

from kvwrite.testing import handoff


def main() -> None:
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    cases = handoff.default_cases()
    if "RANK" in os.environ:  # torchrun: this process is one rank
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
        try:
            handoff.run_rank(rank, device, cases)
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return
    else:
        handoff.spawn(backend, cases)
    where = ("NCCL between cuda:0 and cuda:1" if backend == "nccl" else
             f"gloo between host tensors ({gpus} GPU{'s' * (gpus != 1)} visible: NCCL needs 2)")
    print(f"pd_handoff: {len(cases)} handoffs (TP=1->TP=2 and TP=2->TP=1; raw, fp8, nvfp4 pages; "
          f"2 stride-order pairs) over {where}: raw bits and quantized reads checked")


if __name__ == "__main__":
    main()
