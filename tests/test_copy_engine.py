"""The copy-engine path of the transfer ops (kvwrite.kernels.copy_engine, SPEC §9.5): the runs of
hand-built plans against byte offsets computed element by element from the tensors' own strides
(merged greedily where both sides continue), the "auto" rule, and on the GPU the batch, the loop
and run(plan) against torch copies, whole allocations compared."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvwrite.kernels import copy_engine
from kvwrite.testing.compare import assert_caches_equal, storage_bytes
from kvwrite.transfer import CopyJob, PageJob, Side, TransferPlan


def side(t: torch.Tensor) -> Side:
    """A logical [B, H, N, C] view as a Side (byte strides, no offset: data_ptr has it)."""
    es = t.element_size()
    return Side(t, 0, tuple(s * es for s in t.stride()), t.size(0))


def job(src: torch.Tensor, dst: torch.Tensor) -> CopyJob:
    _, H, N, C = src.shape
    return CopyJob(side(src), side(dst), H, N, C, src.element_size())


def plan(jobs, mapping, *, engine="ce", device=None, page_job=None, gpu_mapping=False,
         peer=None):
    mapping = torch.as_tensor(mapping, dtype=torch.int64).reshape(-1, 2)
    return TransferPlan("swap_blocks_multi_layer", tuple(jobs), page_job, mapping,
                        None if gpu_mapping else mapping, mapping.size(0), device, None, engine,
                        {}, **({} if peer is None else {"peer": peer}))


def oracle(pairs, views) -> list[tuple[int, int, int]]:
    """(dst, src, size) of every run: each element's bytes by the tensors' strides (pair by pair,
    h, t, c in order), an element appended to the run before it where both sides continue it."""
    out = []
    for src, dst in views:
        es = src.element_size()
        _, H, N, C = src.shape
        for i, j in pairs:
            run = None
            for h in range(H):
                for t in range(N):
                    for c in range(C):
                        s = src.data_ptr() + es * (i * src.stride(0) + h * src.stride(1)
                                                   + t * src.stride(2) + c * src.stride(3))
                        d = dst.data_ptr() + es * (j * dst.stride(0) + h * dst.stride(1)
                                                   + t * dst.stride(2) + c * dst.stride(3))
                        if run is not None and run[0] + run[2] == d and run[1] + run[2] == s:
                            run[2] += es
                        else:
                            run = [d, s, es]
                            out.append(run)
    return [tuple(r) for r in out]


def got(p) -> list[tuple[int, int, int]]:
    d, s, n = copy_engine.runs(p)
    assert d.dtype == s.dtype == n.dtype == np.uint64
    return list(zip(d.tolist(), s.tolist(), n.tolist(), strict=True))


B, H, N, C = 5, 3, 4, 8
PAIRS = [(3, 0), (0, 4), (4, 2)]


def cache(shape=(B, H, N, C), dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype)


LAYOUTS = {
    # (src, dst) logical [B, H, N, C] views; the comment says the runs a pair gives.
    "same layout: one run a pair": lambda: (cache(), cache()),
    "LBNHC -> LBHNC: one run a row": lambda: (cache((B, N, H, C)).permute(0, 2, 1, 3), cache()),
    "heads padded on dst: one run a head": lambda: (cache(), cache((B, H, N + 2, C))[:, :, :N]),
    "a head slice of a larger dst: one run a pair": lambda: (cache(),
                                                             cache((B, H + 2, N, C))[:, 1:1 + H]),
    "padded blocks, K half of K|V rows: one run a row": lambda: (
        cache((B + 1, H, N, 2 * C))[1:, :, :, :C], cache((B, H, N, 2 * C))[..., C:]),
    "every other element: one run an element": lambda: (cache((B, H, N, 2 * C))[..., ::2],
                                                         cache()),
    "uint8 rows": lambda: (cache(dtype=torch.uint8), cache((B, N, H, C), torch.uint8)
                           .permute(0, 2, 1, 3)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_runs_are_the_runs_both_sides_share(name):
    src, dst = LAYOUTS[name]()
    assert got(plan([job(src, dst)], PAIRS)) == oracle(PAIRS, [(src, dst)])


def test_runs_count_per_pair_as_documented():
    same, rows, heads, elems = (LAYOUTS[k]() for k in (
        "same layout: one run a pair", "LBNHC -> LBHNC: one run a row",
        "heads padded on dst: one run a head", "every other element: one run an element"))
    es = 2
    for (src, dst), count, size in [(same, 1, H * N * C * es), (rows, H * N, C * es),
                                    (heads, H, N * C * es), (elems, H * N * C, es)]:
        d, s, n = copy_engine.runs(plan([job(src, dst)], PAIRS))
        assert d.size == len(PAIRS) * count and set(n.tolist()) == {size}
        assert copy_engine.run_bytes(job(src, dst)) == size


def test_runs_of_several_jobs_follow_the_jobs_then_the_pairs():
    views = [LAYOUTS["same layout: one run a pair"](), LAYOUTS["LBNHC -> LBHNC: one run a row"](),
             LAYOUTS["every other element: one run an element"]()]
    p = plan([job(s, d) for s, d in views], PAIRS)
    assert got(p) == oracle(PAIRS, views)


def test_runs_take_int32_and_strided_cpu_mappings():
    src, dst = LAYOUTS["LBNHC -> LBHNC: one run a row"]()
    wide = torch.tensor([[9, 3, 7, 0], [9, 0, 7, 4], [9, 4, 7, 2]], dtype=torch.int32)
    mapping = wide[:, 1::2]  # column 0 the sources, 1 the destinations; strides (4, 2)
    p = TransferPlan("relayout_kv_cache", (job(src, dst),), None, mapping, mapping, 3, None,
                     None, "ce", {})
    assert got(p) == oracle(PAIRS, [(src, dst)])


def test_no_pairs_or_no_elements_give_no_runs():
    src, dst = LAYOUTS["same layout: one run a pair"]()
    assert got(plan([job(src, dst)], torch.zeros(0, 2))) == []
    empty = CopyJob(side(src), side(dst), H, 0, C, 2)
    assert got(plan([empty], PAIRS)) == []


def test_runs_refuse_a_gpu_mapping():
    src, dst = LAYOUTS["same layout: one run a pair"]()
    with pytest.raises(ValueError, match="^block_mapping"):
        copy_engine.runs(plan([job(src, dst)], PAIRS, gpu_mapping=True))


def test_runs_of_many_jobs_of_mixed_layouts_match_the_element_loop():
    """Many jobs, their geometries interleaved (so each geometry's runs are placed among the
    others'), an empty job among them, more pairs: the runs (built per geometry at once) are the
    element-by-element oracle's, in job then pair order."""
    names = list(LAYOUTS)
    views = [LAYOUTS[names[k % len(names)]]() for k in range(17)]
    pairs = [(i, (i * 2 + 1) % B) for i in range(B)] + [(0, 0)]
    jobs = [job(s, d) for s, d in views]
    src, dst = LAYOUTS["same layout: one run a pair"]()
    jobs.insert(5, CopyJob(side(src), side(dst), H, N, 0, 2))  # no elements: no runs
    assert got(plan(jobs, pairs)) == oracle(pairs, views)
    alone = [copy_engine.job_runs(j, [i for i, _ in pairs], [d for _, d in pairs]) for j in jobs]
    d, s, n = copy_engine.runs(plan(jobs, pairs))
    for k, whole in enumerate((d, s, n)):
        assert whole.tolist() == np.concatenate([a[k] for a in alone]).tolist()


# --- the submission (the driver's entry point replaced by a recorder) -----------------------------

class Recorder:
    """A C function of cuMemcpyBatchAsync's CUDA 12.8 signature that records what it was given,
    read through its pointers, and returns ``result`` (writing ``fail`` into failIdx)."""

    def __init__(self, result=0, fail=None):
        self.calls, self.result, self.fail = [], result, fail
        import ctypes

        proto = ctypes.CFUNCTYPE(ctypes.c_int, *copy_engine._ENTRY_ARGS)

        def entry(dsts, srcs, sizes, count, attrs, idxs, num_attrs, fail_idx, stream):
            def u64(ptr, n):
                return list((ctypes.c_uint64 * n).from_address(ptr)) if n else []
            self.calls.append(dict(
                dsts=u64(dsts, count), srcs=u64(srcs, count), sizes=u64(sizes, count),
                count=count, attrs=bytes((ctypes.c_ubyte * 24).from_address(attrs)),
                idxs=u64(idxs, num_attrs), num_attrs=num_attrs, stream=stream,
                fail_idx=ctypes.c_size_t.from_address(fail_idx).value))
            if self.fail is not None:
                ctypes.c_size_t.from_address(fail_idx).value = self.fail
            return self.result
        self.fn = proto(entry)


def test_batch_passes_the_arrays_and_stream_order_to_the_driver(monkeypatch):
    pytest.importorskip("cuda.bindings")
    rec = Recorder()
    monkeypatch.setattr(copy_engine, "_batch_entry", lambda: rec.fn)
    src, dst = LAYOUTS["LBNHC -> LBHNC: one run a row"]()
    d, s, n = copy_engine.runs(plan([job(src, dst)] * 3, PAIRS))
    copy_engine.copy_batch(d, s, n, 0x1234, GPU)
    (call,) = rec.calls
    assert (call["dsts"], call["srcs"], call["sizes"]) == (d.tolist(), s.tolist(), n.tolist())
    assert call["count"] == n.size == 3 * len(PAIRS) * H * N and call["stream"] == 0x1234
    # CUmemcpyAttributes: srcAccessOrder STREAM (1), no location hints, flags
    # PREFER_OVERLAP_WITH_COMPUTE (1); one set, from copy 0.
    order, hints, flags = (int.from_bytes(call["attrs"][a:b], "little")
                           for a, b in ((0, 4), (4, 20), (20, 24)))
    assert (order, hints, flags) == (1, 0, 1)
    assert call["idxs"] == [0] and call["num_attrs"] == 1
    assert call["fail_idx"] == 2**64 - 1
    # Lists of ints are taken too (the benchmark's peers pass arrays; any sequence works).
    copy_engine.copy_batch(d.tolist(), s.tolist(), n.tolist(), 7, GPU)
    assert rec.calls[1]["dsts"] == d.tolist() and rec.calls[1]["stream"] == 7


@pytest.mark.parametrize("fail", [3, None])
def test_batch_failure_names_the_copy_and_the_error(monkeypatch, fail):
    pytest.importorskip("cuda.bindings")
    monkeypatch.setattr(copy_engine, "_batch_entry", lambda: Recorder(1, fail).fn)
    where = " at copy 3" if fail is not None else ""
    with pytest.raises(RuntimeError, match=f"^cuMemcpyBatchAsync failed{where}: "
                                           f".*CUDA_ERROR_INVALID_VALUE"):
        copy_engine.copy_batch([1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1], 7, GPU)


def test_batch_refuses_arrays_of_different_lengths_before_the_driver(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(copy_engine, "_batch_entry", lambda: rec.fn)
    with pytest.raises(ValueError, match="^copy_batch: expected as many destinations, sources "
                                         "and sizes, got 2, 3 and 3"):
        copy_engine.copy_batch([1, 2], [5, 6, 7], [1, 1, 1], 7, GPU)
    assert rec.calls == []


class FakeDriver:
    def __init__(self, version):
        self.version = version

    def cuDriverGetVersion(self):  # noqa: N802 (the driver's name)
        return 0, self.version


@pytest.mark.parametrize("version, symbol, want", [
    (12040, True, "the driver supports CUDA 12.4; cuMemcpyBatchAsync needs 12.8 or later"),
    (12080, False, "the driver library has no cuMemcpyBatchAsync (undefined symbol)"),
    (12080, True, None), (13000, True, None)])
def test_batch_reason_needs_a_12_8_driver_that_exports_the_batch(monkeypatch, version, symbol,
                                                                 want):
    def entry():
        if not symbol:
            raise AttributeError("undefined symbol")
        return None
    monkeypatch.setattr(copy_engine, "loop_reason", lambda device: None)
    monkeypatch.setattr(copy_engine, "_driver", lambda: FakeDriver(version))
    monkeypatch.setattr(copy_engine, "_batch_entry", entry)
    assert copy_engine.batch_reason.__wrapped__(GPU) == want


# --- the rule --------------------------------------------------------------------------------------

GPU = torch.device("cuda", 0)


def device_side(shape, dtype=torch.bfloat16) -> torch.Tensor:
    """A tensor that is not on the host (meta: the rule reads only devices and strides)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def big_job(n_bytes_per_pair: int, d2h=True, rows=False) -> CopyJob:
    """A job whose runs are ``n_bytes_per_pair`` (one a pair), or one a row (``rows``)."""
    h, n = 2, 4
    c = n_bytes_per_pair // (2 * h * n)
    host, dev = cache((B, h, n, c)), device_side((B, h, n, c))
    if rows:
        dev = device_side((B, n, h, c)).permute(0, 2, 1, 3)
    return job(dev, host) if d2h else job(host, dev)


@pytest.fixture
def batched(monkeypatch):
    monkeypatch.setattr(copy_engine, "batch_reason", lambda device: None)
    monkeypatch.setattr(copy_engine, "loop_reason", lambda device: None)
    monkeypatch.setattr(copy_engine, "capturing", lambda device: False)


RUN64K = 64 * 1024


@pytest.mark.parametrize("d2h", [True, False])
def test_auto_takes_copy_engines_for_long_host_device_runs(batched, d2h):
    assert copy_engine.resolve(plan([big_job(RUN64K, d2h)], PAIRS, engine="auto",
                                    device=GPU)) == "ce"
    assert copy_engine.resolve(plan([big_job(RUN64K, d2h), big_job(4 * RUN64K, d2h)], PAIRS,
                                    engine="auto", device=GPU)) == "ce"


@pytest.mark.parametrize("case", ["short runs", "one job's short runs", "rows", "d2d",
                                  "gpu mapping", "no pairs", "no batch", "capture", "page job",
                                  "host to host", "sm", "peer"])
def test_auto_keeps_sms_otherwise(batched, monkeypatch, case):
    jobs, kw = [big_job(RUN64K)], dict(engine="auto", device=GPU)
    pairs = PAIRS
    if case == "short runs":
        jobs = [big_job(RUN64K // 2)]
    elif case == "one job's short runs":
        jobs = [big_job(RUN64K), big_job(RUN64K // 2, d2h=False)]
    elif case == "rows":  # a layout change splits every block into rows of 1 KiB
        jobs = [big_job(RUN64K, rows=True)]
    elif case == "d2d":
        jobs = [job(device_side((B, 2, 4, RUN64K // 16)), device_side((B, 2, 4, RUN64K // 16)))]
    elif case == "gpu mapping":
        kw["gpu_mapping"] = True
    elif case == "no pairs":
        pairs = torch.zeros(0, 2)
    elif case == "no batch":
        monkeypatch.setattr(copy_engine, "batch_reason", lambda device: "driver 12.4")
    elif case == "capture":
        monkeypatch.setattr(copy_engine, "capturing", lambda device: True)
    elif case == "page job":
        kw["page_job"] = object.__new__(PageJob)
    elif case == "host to host":
        kw["device"] = None
    elif case == "sm":
        kw["engine"] = "sm"
    elif case == "peer":  # a call across two GPUs: "sm" whatever its runs (docs/ops/transfer.md)
        kw["peer"] = torch.device("cuda", 1)
    assert copy_engine.resolve(plan(jobs, pairs, **kw)) == "sm"


def test_ce_is_taken_as_asked_but_never_captured(batched, monkeypatch):
    short = plan([big_job(1024)], PAIRS, engine="ce", device=GPU)
    assert copy_engine.resolve(short) == "ce"
    c = RUN64K // 16
    d2d = plan([job(device_side((B, 2, 4, c)), device_side((B, 2, 4, c)))], PAIRS, engine="ce",
               device=GPU)
    assert copy_engine.resolve(d2d) == "ce"
    monkeypatch.setattr(copy_engine, "capturing", lambda device: True)
    with pytest.raises(ValueError, match="^engine: 'ce' cannot be captured"):
        copy_engine.resolve(short)
    assert copy_engine.resolve(plan([big_job(1024)], PAIRS, engine="ce", device=None)) == "sm"


def test_ce_with_what_the_op_refuses_first_is_a_bug(batched):
    with pytest.raises(AssertionError):
        copy_engine.resolve(plan([big_job(RUN64K)], PAIRS, engine="ce", device=GPU,
                                 gpu_mapping=True))
    with pytest.raises(AssertionError):
        copy_engine.resolve(plan([], PAIRS, engine="ce", device=GPU,
                                 page_job=object.__new__(PageJob)))


def test_batch_reason_without_a_gpu_says_why():
    assert copy_engine.batch_reason(torch.device("cpu")).startswith("copy engines need a CUDA")
    if not torch.cuda.is_available():
        reason = copy_engine.batch_reason(torch.device("cuda", 0))
        assert reason is None or isinstance(reason, str)


def test_peer_access_is_never_enabled_under_capture(monkeypatch):
    """CUDA refuses cuCtxEnablePeerAccess during a graph capture, even for access already on,
    and the refusal invalidates the capture (two H200s): a captured call of a pair this process
    has not enabled raises saying what to do, before any driver call; an enabled pair passes."""
    class NoDriver:
        def __getattr__(self, name):
            raise AssertionError(f"driver call {name} under capture")

    monkeypatch.setattr(copy_engine, "_driver", NoDriver)
    monkeypatch.setattr(copy_engine, "capturing", lambda device: True)
    monkeypatch.setattr(copy_engine, "_PEERS", set())
    a, b = torch.device("cuda", 1), torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="from cuda:1 to cuda:0 was not enabled by an earlier "
                                           "call.*before capturing"):
        copy_engine.enable_peer_access(a, b)
    copy_engine._PEERS.add((1, 0))
    copy_engine.enable_peer_access(a, b)


# --- the GPU ---------------------------------------------------------------------------------------

def gpu_views(direction: str, layout: str):
    """(src, dst) views of one [B, H, N, C] bf16 cache pair on the GPU and/or pinned host,
    filled with random bytes (dst too: what is not written must keep them)."""
    gen = torch.Generator().manual_seed(7)

    def alloc(shape, where):
        t = torch.randint(0, 256, (int(np.prod(shape)) * 2,), dtype=torch.uint8, generator=gen)
        t = t.view(torch.bfloat16).view(shape)
        return t.cuda() if where == "gpu" else t.pin_memory()

    src_at, dst_at = {"d2h": ("gpu", "host"), "h2d": ("host", "gpu"),
                      "d2d": ("gpu", "gpu")}[direction]
    if layout == "same":
        return alloc((B, H, N, C), src_at), alloc((B, H, N, C), dst_at)
    if layout == "rows":
        return (alloc((B, N, H, C), src_at).permute(0, 2, 1, 3),
                alloc((B + 1, H, N, 2 * C), dst_at)[1:, :, :, C:])
    return alloc((B, H, N, 2 * C), src_at)[..., ::2], alloc((B, H, N + 1, C), dst_at)[:, :, :N]


def expected(src, dst, pairs):
    """A copy of dst's whole allocation with torch's element copies of the pairs."""
    want = storage_bytes(dst).cpu().clone()
    view = want.view(dst.dtype).as_strided(dst.shape, dst.stride(), dst.storage_offset())
    for i, j in pairs:
        view[j] = src[i].cpu()
    return view


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
@pytest.mark.parametrize("layout", ["same", "rows", "elements"])
@pytest.mark.parametrize("how", ["batch", "loop"])
@pytest.mark.parametrize("on", ["default stream", "side stream"])
def test_gpu_run_writes_what_torch_copies(monkeypatch, direction, layout, how, on):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if how == "batch" and copy_engine.batch_reason(GPU) is not None:
        pytest.skip(copy_engine.batch_reason(GPU))
    if how == "loop":
        monkeypatch.setattr(copy_engine, "batch_reason", lambda device: "forced: the loop")
    src, dst = gpu_views(direction, layout)
    want = expected(src, dst, PAIRS)
    p = plan([job(src, dst)], PAIRS, device=GPU)
    stream = torch.cuda.current_stream() if on == "default stream" else torch.cuda.Stream()
    with torch.cuda.stream(stream):
        copy_engine.run(p)
    stream.synchronize()
    assert_caches_equal(dst, want, f"{direction} {layout} {how}")


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_gpu_batch_and_loop_of_many_layers(direction):
    """vLLM's unit: every layer's block as one run, 64 tensors, in one batch or one loop."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    layers = [gpu_views(direction, "same") for _ in range(64)]
    pairs = [(i, (i * 3 + 1) % B) for i in range(B)]
    wants = [expected(s, d, pairs) for s, d in layers]
    p = plan([job(s, d) for s, d in layers], pairs, device=GPU)
    dst_ptrs, src_ptrs, sizes = copy_engine.runs(p)
    assert sizes.size == 64 * B
    stream = copy_engine.stream_handle(GPU)
    if copy_engine.batch_reason(GPU) is None:
        copy_engine.copy_batch(dst_ptrs, src_ptrs, sizes, stream, GPU)
        torch.cuda.synchronize()
        for (_, d), w in zip(layers, wants, strict=True):
            assert_caches_equal(d, w, "batch")
    for _, d in layers:  # the loop again over fresh destinations
        d.copy_(torch.zeros_like(d))
    wants = [expected(s, d, pairs) for s, d in layers]
    copy_engine.copy_loop(dst_ptrs, src_ptrs, sizes, stream)
    torch.cuda.synchronize()
    for (_, d), w in zip(layers, wants, strict=True):
        assert_caches_equal(d, w, "loop")


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_gpu_run_of_interleaved_layouts_writes_what_torch_copies(direction):
    """Jobs of three geometries interleaved (each geometry's runs placed among the others')."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    layers = [gpu_views(direction, ("same", "rows", "elements")[k % 3]) for k in range(9)]
    wants = [expected(s, d, PAIRS) for s, d in layers]
    copy_engine.run(plan([job(s, d) for s, d in layers], PAIRS, device=GPU))
    torch.cuda.synchronize()
    for k, ((_, d), w) in enumerate(zip(layers, wants, strict=True)):
        assert_caches_equal(d, w, f"layer {k}")


@pytest.mark.gpu
def test_gpu_capture_refuses_ce_and_auto_keeps_sms():
    """Under a real CUDA-graph capture: "ce" raises naming engine, "auto" takes SMs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    src, dst = gpu_views("d2h", "same")
    big = [job(src, dst)]
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with pytest.raises(ValueError, match="^engine: 'ce' cannot be captured"):
                copy_engine.resolve(plan(big, PAIRS, engine="ce", device=GPU))
            auto = copy_engine.resolve(plan(big, PAIRS, engine="auto", device=GPU))
        finally:
            graph.capture_end()
    assert auto == "sm"
