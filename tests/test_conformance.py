"""One conformance suite over the registry: every registered op × its cases × every
implementation, from the op's provider (``kvwrite.testing.providers.<op>``, see
:mod:`kvwrite.testing.conformance`):

- the whole allocation of every written argument byte for byte against the reference;
- deliberately wrong writers are caught by that comparison;
- bad input raises a clear error and changes no byte of any tensor given;
- a captured CUDA graph replayed after every input (scales included) changed in place writes
  what the reference writes for the new inputs (GPU);
- ``torch.compile`` captures the op as one mutating custom op and writes the reference's bytes;
- NVRTC compiles every CUDA variant of the op (no GPU needed);
- the Triton implementation with every launch forced to 1 and to 2 warps writes the reference's
  bytes (GPU; Triton 3.6 miscompiled one-warp programs on small tiles), and the forcing reaches
  every kernel kvwrite launches (under the interpreter).

Per-op test files keep what is specific to an op's arithmetic.
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import torch

from kvwrite import registry
from kvwrite.testing import conformance
from kvwrite.testing.compare import copy_allocations, storage_bytes
from kvwrite.testing.compile import compiled_targets
from kvwrite.transfer import TransferPlan
from sass import needs_nvrtc
from triton_warps import forced_warps, kernel_name, launched_kernels

PROVIDERS = conformance.providers()


def _params(kind: str, with_impls=lambda info: True, gpu: bool = False):
    """(provider, example, implementation, device) for every example of ``kind``: on the CPU
    and the GPU, or (``gpu`` or the example's own ``gpu``) on the GPU only, with the marker."""
    out = []
    for p in PROVIDERS:
        for ex in getattr(p, kind):
            devices = ["cuda"] if gpu or ex.gpu else ["cpu", "cuda"]
            for info in registry.all_impls(p.op):
                if not with_impls(info):
                    continue
                for device in devices:
                    marks = (pytest.mark.gpu,) if device == "cuda" else ()
                    out.append(pytest.param(p, ex, info.name, device, marks=marks,
                                            id=f"{p.op}-{ex.id}-{info.name}-{device}"))
    return out


def _runnable(p, info, case, device: str, args: tuple, graph: bool = False) -> None:
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    if (reason := p.why_not(info, case, args, graph)) is not None:
        pytest.skip(reason)


def _call(p, args: tuple, impl: str) -> None:
    """``impl`` on ``args``; a skip where the registry says it cannot run this call (what its
    ``unsupported`` refuses, e.g. a cast Triton's interpreter rounds otherwise)."""
    try:
        p.call(*args, implementation=impl)
    except ValueError as e:
        if "cannot run this call" in str(e):
            pytest.skip(str(e))
        raise
    if torch.cuda.is_initialized():
        # A GPU call's writes into pinned host memory are there once its stream is done; the
        # checks read host memory directly.
        torch.cuda.synchronize()


def test_every_registered_op_has_a_provider():
    """A new op must declare its cases for this suite (kvwrite.testing.providers.<op>)."""
    assert conformance.missing_providers() == []
    assert [p.op for p in PROVIDERS] == registry.ops()


@pytest.mark.parametrize("p", PROVIDERS, ids=lambda p: p.op)
def test_every_op_registers_its_three_implementations(p):
    """kvwrite's own implementations of the op (peers, ``ops/<op>/peers/``, aside): the CUDA
    kernel, Triton's and the torch reference, in that order of preference; the CUDA kernel
    says it runs on CUDA devices only."""
    own = [i.name for i in registry.all_impls(p.op) if ".peers." not in i.module]
    assert own == ["cuda", "triton", "torch"]
    assert {s.name for s in registry.implementations("cpu", p.op)} >= set(own)
    assert "CUDA devices only" in registry.get(p.op, "cuda").available("cpu")


# --- bytes against the reference -----------------------------------------------------------------

@pytest.mark.parametrize("p, ex, impl, device", _params("byte_cases"))
def test_bytes_match_the_reference(p, ex, impl, device):
    info = registry.get(p.op, impl)
    args = p.build(ex.case, device, 0)
    _runnable(p, info, ex.case, device, args)
    want = conformance.run_reference(p, p.build(ex.case, "cpu", 0))
    _call(p, args, impl)
    p.compare(ex.case, copy_allocations(conformance.written(p, args), "cpu"), want)


# --- the checker can fail ------------------------------------------------------------------------

def _wrong_params():
    return [pytest.param(p, w, id=f"{p.op}-{w.id}") for p in PROVIDERS for w in p.wrong_writers]


@pytest.mark.parametrize("p, wrong", _wrong_params())
def test_wrong_writer_is_caught(p, wrong):
    args = p.build(wrong.case, "cpu", 0)
    want = conformance.run_reference(p, args)
    wrong.write(*args)
    with pytest.raises(AssertionError, match="differ"):
        p.compare(wrong.case, conformance.written(p, args), want)


# --- validation ----------------------------------------------------------------------------------

def _bad_params():
    return [pytest.param(p, b, id=f"{p.op}-{b.id}") for p in PROVIDERS for b in p.bad_inputs]


@pytest.mark.parametrize("p, bad", _bad_params())
def test_bad_input_is_rejected_and_nothing_changes(p, bad):
    args, kwargs = bad.make()
    before = conformance.snapshot(args, kwargs)
    with pytest.raises(bad.exc, match=re.escape(bad.text)):
        (bad.call or p.public or p.call)(*args, **kwargs)
    assert conformance.unchanged(before)


# --- CUDA graphs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("p, ex, impl, device", _params("graph_cases",
                                                        lambda info: info.graph_safe, gpu=True))
def test_cuda_graph_replay_sees_new_inputs(p, ex, impl, device):
    """Capture once, then change every tensor argument (inputs, slots, scales, and the caches'
    starting bytes) in place to another seed's: the replay writes what the reference writes for
    the new ones."""
    info = registry.get(p.op, impl)
    seed, *new_seeds = p.graph_seeds
    first = p.build(ex.case, "cuda", seed)
    _runnable(p, info, ex.case, "cuda", first, graph=True)
    if p.graph_warmup:
        _call(p, first, impl)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.call(*first, implementation=impl)
    for new_seed in new_seeds:
        second = p.build(ex.case if p.replay_case is None else p.replay_case(ex.case), "cuda",
                         new_seed)
        for dst, src in zip(conformance.tensors(p, first), conformance.tensors(p, second),
                            strict=True):
            storage_bytes(dst).copy_(storage_bytes(src))
        want = conformance.run_reference(p, second)
        graph.replay()
        torch.cuda.synchronize()
        p.compare(ex.case, conformance.written(p, first), want)
        if p.graph_check is not None:
            p.graph_check(first)


# --- torch.compile -------------------------------------------------------------------------------

@pytest.mark.parametrize("p, ex, impl, device", _params("compile_cases"))
def test_torch_compile_sees_one_mutating_custom_op(p, ex, impl, device):
    info = registry.get(p.op, impl)
    args = p.build(ex.case, device, 0)
    _runnable(p, info, ex.case, device, args)
    _call(p, conformance.with_copies(p, args)[0], impl)  # eagerly first: can it run the call?
    at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def step(*tensors):
        full = list(args)
        for i, t in zip(at, tensors, strict=True):
            full[i] = t
        p.call(*full, implementation=impl)

    assert compiled_targets(step, *[args[i] for i in at]) == p.compiled_targets

    # Through AOT autograd's functionalization too, on fresh arguments.
    args = p.build(ex.case, device, 0)
    want = conformance.run_reference(p, p.build(ex.case, "cpu", 0))
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="aot_eager")(*[args[i] for i in at])
    p.compare(ex.case, copy_allocations(conformance.written(p, args), "cpu"), want)


# --- NVRTC -----------------------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("p", [pytest.param(p, id=p.op) for p in PROVIDERS
                               if p.compile_variants is not None])
def test_nvrtc_compiles_every_variant(p):
    p.compile_variants()


# --- Triton at forced warps ------------------------------------------------------------------------

# Byte cases of each op run at forced warps: at most this many, spread over its list (its formats
# and call sizes, not every layout of each), since each case and warp count is a Triton compile
# on the GPU; with the small tiles, about 300 GPU items.
FORCED_BYTE_CASES = 6


def _spread(examples: tuple, n: int) -> list:
    """``n`` of ``examples`` evenly spread over them, the first and the last among them."""
    if len(examples) <= n:
        return list(examples)
    return [examples[round(i * (len(examples) - 1) / (n - 1))] for i in range(n)]


def _forced_params():
    return [pytest.param(p, ex, warps, marks=pytest.mark.gpu, id=f"{p.op}-{ex.id}-w{warps}")
            for p in PROVIDERS
            for ex in (*_spread(p.byte_cases, FORCED_BYTE_CASES), *p.small_tile_cases)
            for warps in (1, 2)]


def test_every_op_has_small_tiles():
    """The forced-warps tests run each op's small tiles (kvwrite.testing.conformance.Provider)."""
    assert [p.op for p in PROVIDERS if not p.small_tile_cases] == []


def test_forced_warps_restores_triton_on_an_exception():
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def runs():
        return [cls.__dict__.get("run") for cls in (JITFunction, InterpretedFunction)]
    before = runs()
    with pytest.raises(RuntimeError, match="inside"), forced_warps(1):
        assert all(a is not b for a, b in zip(runs(), before, strict=True))
        raise RuntimeError("inside")
    assert runs() == before


def _run_calls(p, args: tuple, monkeypatch) -> list[tuple[tuple, dict]]:
    """The arguments of each ``run`` the op calls for ``args`` on the CPU, recorded from its
    torch implementation's (every implementation's ``run`` takes the same)."""
    module = importlib.import_module(registry.get(p.op, "torch").module)
    calls, real = [], module.run

    def record(*a, **k):
        calls.append((a, k))
        real(*a, **k)
    with monkeypatch.context() as m:
        m.setattr(module, "run", record)
        p.call(*args, implementation="torch")
    return calls


def _on_the_cpu(a):
    """A host-to-host transfer plan (the torch implementation's alone: no device) as the Triton
    kernels take the CPU's under the interpreter (tests/test_transfer_triton.py's plans)."""
    if isinstance(a, TransferPlan) and a.device is None:
        return dataclasses.replace(a, device=torch.device("cpu"))
    return a


def test_forced_warps_reach_every_triton_launch(monkeypatch):
    """Every op's Triton implementation on each of its small tiles under the interpreter, inside
    ``forced_warps(1)``: every launch the interpreter is handed (``GridExecutor``, past the
    kernel object that forced_warps patches) has ``num_warps=1``, and the kernels launched are
    every kernel kvwrite launches (``launched_kernels``, read from the source: a new kernel that
    no small tile reaches fails here). Only the launches are checked, not the bytes, so the
    implementation's ``run`` takes the op's run arguments directly, past the calls the
    interpreter refuses (its casts) and the host-to-host transfers only the torch
    implementation runs."""
    if (reason := registry.get(PROVIDERS[0].op, "triton").available("cpu")) is not None:
        pytest.skip(reason)
    from triton.runtime.interpreter import GridExecutor

    handed: list[tuple[str, int | None]] = []
    real = GridExecutor.__call__

    def spy(self, *args, **kwargs):
        handed.append((kernel_name(self), kwargs.get("num_warps")))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(GridExecutor, "__call__", spy)
    for p in PROVIDERS:
        run = registry.get(p.op, "triton").run
        for ex in p.small_tile_cases:
            for a, k in _run_calls(p, p.build(ex.case, "cpu", 0), monkeypatch):
                before = len(handed)
                with forced_warps(1) as launches:
                    run(*map(_on_the_cpu, a), **k)
                # Each launch the interpreter was handed went through forced_warps.
                assert len(launches) == len(handed) - before, (p.op, ex.id)

    assert handed
    other = sorted({f"{kernel} at {warps}" for kernel, warps in handed if warps != 1})
    assert other == [], "launches forced_warps(1) did not reach"
    kernels = {kernel for kernel, _ in handed}
    assert sorted(launched_kernels() - kernels) == [], "kernels no op's small tile launches"
    assert sorted(kernels - launched_kernels()) == [], "launched, but not in launched_kernels()"


@pytest.mark.parametrize("p, ex, warps", _forced_params())
def test_triton_at_forced_warps_matches_the_reference(p, ex, warps):
    """The Triton implementation with every launch at ``warps`` warps, whatever its tuning says:
    the whole allocation of every written argument byte for byte against the reference, and
    every kernel compiled at ``warps`` (the compiled kernels' own record)."""
    info = registry.get(p.op, "triton")
    args = p.build(ex.case, "cuda", 0)
    _runnable(p, info, ex.case, "cuda", args)
    want = conformance.run_reference(p, p.build(ex.case, "cpu", 0))
    with forced_warps(warps) as launches:
        _call(p, args, "triton")
    # A case that launched nothing would check nothing.
    assert launches and {launch.num_warps for launch in launches} == {warps}, launches
    p.compare(ex.case, copy_allocations(conformance.written(p, args), "cpu"), want)
