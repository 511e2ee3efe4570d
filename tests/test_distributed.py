"""Cache pages between two processes (issue #46, part 2): a prefill -> decode handoff through
transfer pages with torch.distributed as the transport, TP = 1 -> TP = 2 and TP = 2 -> TP = 1,
every page format (kvwrite.testing.handoff holds the logic; docs/examples/pd_handoff.py runs it).
The CPU variant (gloo, host tensors, two spawned processes) runs everywhere; the GPU variant
(NCCL, cuda:0 and cuda:1) needs two GPUs."""

import pytest
import torch

from kvwrite.testing import handoff


def test_handoff_between_two_processes_on_the_cpu():
    # Every destination byte is checked in the children; a wrong one fails a child's check, whose
    # traceback spawn() raises with.
    cases = handoff.default_cases()
    lines = handoff.spawn("gloo", cases, timeout=90)
    assert len(lines) == 2 * len(cases), lines
    assert all(": heads" in line or ": all" in line for line in lines), lines


def test_the_check_sees_a_wrong_byte_outside_the_mapped_blocks():
    # The handoff's check compares whole allocations: a byte changed in a block no row maps
    # fails it, naming the rank and the case.
    case = handoff.Case("tp1_to_tp2", "raw", "LBNHC", "LBHNC")
    dst = handoff.LAYOUTS["LBHNC"]("cpu", handoff.HALF)
    for t in dst:
        t.zero_()
    before = [t.clone() for t in dst]
    want = [t[handoff.DST_BLOCKS].clone() for t in dst]
    handoff._check(1, case, dst, before, want)  # nothing written, nothing expected: passes
    unmapped = next(b for b in range(handoff.BLOCKS) if b not in handoff.DST_BLOCKS)
    dst[1][unmapped, 0, 0, 0] = 1.0
    with pytest.raises(AssertionError, match=r"rank 1, tp1_to_tp2 raw LBNHC->LBHNC: the "
                                             r"destination allocation of layer 1: 2 of"):
        handoff._check(1, case, dst, before, want)


def test_a_bad_case_is_refused_before_any_process_starts():
    # A case no rank could run (an unknown stride order): ValueError in the parent, no child.
    with pytest.raises(ValueError, match="a handoff case"):
        handoff.spawn("gloo", [("tp1_to_tp2", "raw", "LBNHC", "NOPE")])


TWO_GPUS = torch.cuda.device_count() >= 2
needs_two_gpus = pytest.mark.skipif(
    not TWO_GPUS, reason=f"needs 2 CUDA GPUs for NCCL (torch.cuda.device_count() is "
                         f"{torch.cuda.device_count()})")


@pytest.mark.gpu
@needs_two_gpus
def test_handoff_between_two_gpus_with_nccl():
    # cuda:0 and cuda:1, NCCL send/recv, the default implementation (the GPU kernels); every
    # format, three (source order, destination order) pairs.
    cases = handoff.default_cases(pairs=(("LBNHC", "LBHNC"), ("BHLNC", "LBNHC"),
                                         ("LBHNC", "BLNHC")))
    lines = handoff.spawn("nccl", cases, timeout=300)
    assert len(lines) == 2 * len(cases), lines
