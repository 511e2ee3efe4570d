"""The CUDA transfer kernels (kvwrite.kernels.transfer_cuda, transfer.cu; SPEC §9) on plans built
by hand: NVRTC compiles of every variant and the launch planning on the CPU; on the GPU, raw
copies against a per-pair torch loop over whole allocations (dense and element-by-element rows,
odd strides and pointers, int32/int64 strided mappings, out-of-range ids, max_ctas, pinned host
sides, graph capture of a first call, 40 jobs in one call) and quantized pages against the torch
rules (tools/sanitize/transfer_plans.py holds the plans and oracles)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from kvwrite.kernels import launch, nvrtc
from kvwrite.kernels import transfer_cuda as tc
from kvwrite.testing.compare import storage_bytes
from kvwrite.transfer import CopyJob, Side
from sass import needs_nvrtc
from tools.sanitize import transfer_plans as tp

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ------------------------------------------------------------------------------------------
# Compiles and launch planning (no GPU needed)
# ------------------------------------------------------------------------------------------
@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("family", ["copy", "pack", "unpack"])
def test_nvrtc_compile_every_variant(arch, family, tmp_path):
    """Every variant compiles; on sm_90 every page variant can launch within the launch bounds'
    64 registers a thread (TUNING's 1024-thread CTAs) and without local memory, but the NVFP4
    pack's at most 64 bytes of spilled invariants (cuobjdump -res-usage, where there is one: the
    same compile, not a second one)."""
    names = [n for n in tc.all_kernel_names() if n.startswith(f"transfer_{family}_kernel<")]
    assert names
    obj, _ = tc.compile_kernel(arch, names)
    assert len(bytes(obj.code)) > 0
    assert set(names) <= set(obj.symbol_mapping)
    sass = importlib.import_module("sass")
    if arch != "sm_90" or family == "copy" or sass.cuobjdump() is None:
        return
    import re
    import subprocess
    path = tmp_path / "k.cubin"
    path.write_bytes(bytes(obj.code))
    out = subprocess.run([sass.cuobjdump(), "-res-usage", str(path)], capture_output=True,
                         text=True, check=True).stdout
    usage = re.findall(r"Function (\S+):\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    assert len(usage) == len(names), out
    for fn, reg, stack, local in usage:
        # The nvfp4 pack's two batches an item spill a few loop invariants (36 bytes at U = 2,
        # bfloat16), measured faster than one batch without (tuning-log 109); no other variant
        # touches local memory.
        most = 64 if "transfer_pack_kernelILi6E" in fn else 0
        assert int(reg) <= 64 and int(stack) <= most and int(local) <= most, (fn, reg, stack)
    assert tc.TUNING.page_threads * 64 <= 65536


@needs_nvrtc
def test_nvrtc_compile_rows_variants_of_one_load():
    """The rows kernel at U = 1 (a tuning of one load in flight) compiles too, every LANES."""
    tuning = tc.TransferTuning(loads_in_flight=1, loads_in_flight_host=1, host_read_rows=1)
    names = [n for n in tc.all_kernel_names(tuning) if n.startswith("transfer_copy_rows_kernel<")]
    assert len(names) == 5 * 2 * 6 and all(", 1, " in n for n in names)
    obj, _ = tc.compile_kernel("sm_90", names)
    assert set(names) <= set(obj.symbol_mapping)


def test_kernel_source_ships_as_package_data():
    import importlib.resources
    res = importlib.resources.files(tc.SOURCE.package).joinpath(tc.SOURCE.filename)
    assert res.is_file() and "transfer_copy_kernel" in res.read_text(encoding="utf-8")
    assert f"#define KVW_SLOTS {tc.SLOTS}" in tc.SOURCE.text
    # page_batches, written twice (transfer.cu's constexpr and transfer_cuda's): the same
    batches = {(f, d): tc.page_batches(f, d) for f in ("nvfp4", "fp8_e4m3", "fp8_e5m2")
               for d in ("pack", "unpack")}
    fp8 = {b for (f, _), b in batches.items() if f != "nvfp4"}
    # fp8 both ways and the nvfp4 pack share one count, the nvfp4 unpack has its own
    assert fp8 == {batches["nvfp4", "pack"]}, batches
    assert (f"return fmt == KVW_NVFP4 && !pack ? {batches['nvfp4', 'unpack']} : {fp8.pop()};"
            in tc.SOURCE.text)


def _cpu_job(shape=(4, 2, 3, 8), dtype=torch.bfloat16, offset=0, src=None, dst=None):
    src = torch.zeros(shape, dtype=dtype) if src is None else src
    dst = torch.zeros(shape, dtype=dtype) if dst is None else dst
    job = tp.copy_job(src, dst)
    if offset:
        job = CopyJob(Side(job.src.tensor, offset, job.src.strides, job.src.blocks), job.dst,
                      job.heads, job.tokens, job.elems, job.elem_bytes)
    return job


def test_copy_launches_group_jobs_into_launches_of_every_slot():
    n = tc.SLOTS + 8
    jobs = tuple(_cpu_job() for _ in range(n))
    ls = tc.copy_launches(jobs)
    assert [len(x.pointers) for x in ls] == [tc.SLOTS, 8]
    assert all(x.vb == 16 for x in ls)
    assert ls[0].pointers[3] == (jobs[3].src.ptr, jobs[3].dst.ptr)


def test_copy_launches_split_by_geometry_and_alignment():
    jobs = (_cpu_job(), _cpu_job(shape=(4, 2, 3, 16)), _cpu_job(offset=2), _cpu_job())
    ls = tc.copy_launches(jobs)
    assert [(x.vb, len(x.pointers)) for x in ls] == [(16, 2), (16, 1), (2, 1)]


def test_copy_launch_vector_width_and_pieces():
    # Rows of 5 float16 (10 bytes): 2-byte vectors, 5 a row.
    base = torch.zeros(4, 2, 3, 7, dtype=torch.float16)
    (x,) = tc.copy_launches((tp.copy_job(base[..., :5], base[..., :5].clone()),))
    assert x.vb == 2 and x.geometry[12:] == (5, 1)
    # Every other float32 (non-dense rows): 4-byte pieces, one an element.
    f = torch.zeros(4, 2, 3, 8, dtype=torch.float32)
    (x,) = tc.copy_launches((tp.copy_job(f[..., ::2], f[..., ::2].clone()),))
    assert x.vb == 4 and x.geometry[12:] == (4, 1) and x.geometry[3] == 8
    # 4-argument form: one long row of 1000 bytes (8-byte vectors).
    t = torch.zeros(6, 128, dtype=torch.float64)
    v = tp.block_bytes_view(t, 1000)
    (x,) = tc.copy_launches((tp.copy_job(v, tp.block_bytes_view(t.clone(), 1000)),))
    assert x.vb == 8 and x.vectors_per_pair == 125


def test_copy_launches_skip_empty_jobs_and_respect_jobs_per_launch():
    empty = tp.copy_job(torch.zeros(4, 2, 0, 8), torch.zeros(4, 2, 0, 8))
    assert tc.copy_launches((empty,)) == []
    tuning = tc.TransferTuning(jobs_per_launch=3)
    assert [len(x.pointers) for x in tc.copy_launches((_cpu_job(),) * 7, tuning)] == [3, 3, 1]


def test_page_launches_runs_of_equal_strides():
    case = tp.PageCase("pack", "fp8_e4m3", torch.bfloat16, L=35)
    caches = [torch.zeros(5, 3, 4, 35, dtype=torch.bfloat16)[..., :32] for _ in range(35)]
    caches[2] = torch.zeros(5, 3, 4, 32, dtype=torch.bfloat16)
    pages = torch.zeros(4, 4 * case.hb, dtype=torch.uint8)
    pj = case.page_job(caches, pages, torch.ones(1))
    ls = tc.page_launches(pj)
    assert [(x.l0, len(x.pointers)) for x in ls] == [(0, 2), (2, 1), (3, 32)]


def _llama_pages(direction="pack", page_format="fp8_e4m3", blocks=4, pairs=None):
    """A PageJob of the benchmark's shape on the CPU (32 layers of (blocks, 8, 16, 256) bfloat16,
    kv_split 2, 8 heads), and a plan over ``pairs`` (default: every block)."""
    L, H, N, C = 32, 8, 16, 256
    case = tp.PageCase(direction, page_format, torch.bfloat16, L=L, S=2, N=N, C=C, Hc=H, Hp=H,
                       K=H, hc0=0, hp0=0, num_blocks=blocks, num_pages=blocks, pad=0, row_pad=0,
                       page_offset=0, scale_shape="tensor",
                       pairs=tuple(pairs or [(i, i) for i in range(blocks)]))
    caches = [torch.zeros(blocks, H, N, C, dtype=torch.bfloat16) for _ in range(L)]
    pages = torch.zeros(blocks, H * case.hb, dtype=torch.uint8)
    pj = case.page_job(caches, pages, torch.ones(1))
    mapping = tp.mapping_tensor(list(case.pairs), torch.int64, "cpu")
    plan = tp.make_plan(f"{direction}_kv_pages", [], mapping, len(case.pairs), None, None, pj)
    return case, plan


@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format", ["fp8_e4m3", "nvfp4"])
def test_page_launch_args_of_the_benchmark_shape(direction, page_format):
    """The benchmark's pages (32 Llama-3-8B layers) take the aligned variant: fp8 in units of one
    16-byte cache vector (8 elements: 16 a row part, 256 a (pair, head, layer, part) segment of 16
    tokens) with U = 4, nvfp4 in groups (8 a row part, 128 a segment) with U = 2: two batches of
    32 * U units a segment either way, in one warp item (page_batches 2) but the nvfp4 unpack's
    in two (1); one header item a chunk (pack), one launch, 1024-thread CTAs, one per SM."""
    case, plan = _llama_pages(direction, page_format, blocks=4)
    (pa,) = tc.page_launch_args(plan, sm_count=132)
    fp8 = page_format != "nvfp4"
    align, unroll, units = (16, 4, 16) if fp8 else (8, 2, 8)  # codes at 4*L*S = 256
    assert pa.name == tc.page_name(direction, page_format, torch.bfloat16, torch.int64, align,
                                   unroll)
    assert pa.threads == 1024
    segs_want = 2 if not fp8 and direction == "unpack" else 1  # page_batches 1 there, else 2
    items = 4 * 8 * (32 * 2 * segs_want + (direction == "pack"))
    assert pa.grid == min(132, -(-items // 32))
    geometry = pa.args[-23:]
    assert geometry[:7] == (0, 32, 32, 2, 16, 128, 8)
    segs, small = geometry[16], geometry[22]
    assert segs == segs_want and small == 1
    assert geometry[17:22] == (tc.magic(32 * 2 * segs + (direction == "pack")), tc.magic(8),
                               tc.magic(segs), tc.magic(2), tc.magic(units))


def test_page_launch_args_grid_and_max_ctas():
    _, plan = _llama_pages(blocks=128)
    (pa,) = tc.page_launch_args(plan, sm_count=132)
    assert pa.grid == 132
    (pa,) = tc.page_launch_args(dataclasses.replace(plan, max_ctas=4), sm_count=132)
    assert pa.grid == 4
    (pa,) = tc.page_launch_args(plan, tc.TransferTuning(page_bytes_in_flight=16), sm_count=132)
    assert pa.name.endswith(", 16, 1>")


@needs_nvrtc
def test_benchmark_page_variants_machine_code(tmp_path):
    """The variants of the benchmark's pages (bfloat16, sm_90): the cache side in 16-byte
    accesses, fp8 codes in 8-byte accesses (a unit's 8 codes) at ALIGN 16 and 4-byte ones at 4,
    NVFP4 codes in 8-byte ones, the fp8 pack by the exact quotient (the saturating paired
    conversion, no bracket: no FMUL.RZ), the hardware fp8 decode and paired rounding in the
    unpack, no local memory (but the nvfp4 pack's spilled invariants)."""
    sass = importlib.import_module("sass").cuobjdump_or_skip()
    bf16, i64 = torch.bfloat16, torch.int64
    want = {
        tc.page_name("pack", "fp8_e4m3", bf16, i64, 16, 4): ("LD.E.128", "ST.E.64",
                                                             "F2FP.SATFINITE.E4M3"),
        tc.page_name("pack", "fp8_e4m3", bf16, i64, 4, 4): ("LD.E.128", "F2FP.SATFINITE.E4M3"),
        tc.page_name("pack", "nvfp4", bf16, i64, 8, 2): ("LD.E.128", "ST.E.64", "VIMNMX3"),
        tc.page_name("unpack", "fp8_e4m3", bf16, i64, 16, 4): ("LD.E.64", "ST.E.128",
                                                               "F2FP.F16.E4M3.UNPACK_B",
                                                               "F2FP.BF16.F32.PACK_AB"),
        tc.page_name("unpack", "nvfp4", bf16, i64, 8, 2): ("LD.E.64", "ST.E.128",
                                                           "F2FP.F16.E4M3.UNPACK_B"),
    }
    for name, ops in want.items():
        cubin, _ = tc.SOURCE.cubin("sm_90", name, ())
        text = sass.dump_sass(cubin, tmp_path)
        for op in ops:
            assert op in text, (name, op)
        if not name.startswith("transfer_pack_kernel<6,"):  # see test_nvrtc_compile_every_variant
            assert "LDL" not in text and "STL" not in text, name
        if name.startswith("transfer_pack_kernel<3,"):  # the quotient, not the bracket (108)
            assert "FMUL.RZ" not in text, name
    text = sass.dump_sass(tc.SOURCE.cubin("sm_90", tc.page_name("pack", "fp8_e4m3", bf16, i64,
                                                                4, 4), ())[0], tmp_path)
    assert "ST.E.64" not in text  # codes 4-byte aligned: two 4-byte stores a unit


def test_unsupported_and_available_without_a_gpu():
    t = torch.zeros(2, 1, 1, 4)
    plan = tp.make_plan("swap_blocks", [tp.copy_job(t, t.clone())], torch.zeros(0, 2), 0, None)
    assert "host" in tc.unsupported(plan)
    if not torch.cuda.is_available():
        assert tc.available(torch.device("cpu")) is not None


# ------------------------------------------------------------------------------------------
# GPU: raw copies
# ------------------------------------------------------------------------------------------
PAIRS, KINDS = tp.PAIRS, tp.COPY_KINDS


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mapping_dtype,strided", [(torch.int64, False), (torch.int32, True)])
@pytest.mark.parametrize("max_ctas", [1, 2, 4, None])
def test_gpu_copy_matches_the_loop(kind, mapping_dtype, strided, max_ctas):
    views = tp.copy_views(kind, "cuda")
    assert tp.run_copy_case("swap_blocks", views, PAIRS, tc.run, mapping_dtype=mapping_dtype,
                            strided_mapping=strided, max_ctas=max_ctas) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("most", [1, 2, 4, 8])
def test_gpu_copy_every_segment_length(kind, most):
    """Every U the launcher can pick (a warp's segment of 32 * U vectors, masked at a row's end),
    forced as the largest, on every layout kind."""
    views = tp.copy_views(kind, "cuda")
    tuning = tc.TransferTuning(loads_in_flight=most, loads_in_flight_host=most)
    assert tp.run_copy_case("swap_blocks", views, PAIRS,
                            lambda plan: tc.run(plan, tuning=tuning)) is None


ROW_VECTORS = list(range(1, 41)) + [63, 64, 100, 257]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", list(tp.ROW_LAYOUTS))
@pytest.mark.parametrize("most", [1, 2, 8])
def test_gpu_copy_rows_of_every_length(layout, most):
    """Rows of 1..40 vectors (the rows kernel at every LANES, U 1 and 2) and a few long ones (the
    segments), two jobs a launch, each length at one of max_ctas 1 / 3 / None and int64 or
    strided int32 mappings (rotating), as tests/test_transfer_emu.py runs them on the CPU."""
    tuning = tc.TransferTuning(loads_in_flight=most, loads_in_flight_host=most)
    failures = []
    for k, n in enumerate(ROW_VECTORS):
        views, jobs = tp.row_views(layout, n, "cuda", seed=k)
        mdt, strided = ((torch.int64, False), (torch.int32, True))[k % 2]
        err = tp.run_copy_case("swap_blocks_multi_layer", views, PAIRS,
                               lambda plan: tc.run(plan, tuning=tuning), mapping_dtype=mdt,
                               strided_mapping=strided, max_ctas=(1, 3, None)[k % 3], jobs=jobs)
        if err is not None:
            failures.append(f"n={n}: {err}")
    assert not failures, "\n".join(failures[:6])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [1, 5, 16, 24, 32])
@pytest.mark.parametrize("pinned", ["src", "dst"])
@pytest.mark.parametrize("max_ctas", [1, 4, None])
def test_gpu_copy_rows_pinned_host_side(n, pinned, max_ctas):
    """Short rows from and to pinned host memory (raw pack to host pages, unpack from them): the
    rows kernel at the host's U, a d2h launch's split threads."""
    views, jobs = tp.row_views("relayout16", n, "cuda", pinned=pinned)
    assert tp.run_copy_case("pack_kv_pages", views, PAIRS, tc.run, max_ctas=max_ctas,
                            jobs=jobs) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["dense", "relayout", "odd", "block_bytes", "long_rows"])
@pytest.mark.parametrize("pinned", ["src", "dst"])
@pytest.mark.parametrize("max_ctas", [4, None])
def test_gpu_copy_pinned_host_side(kind, pinned, max_ctas):
    views = tp.copy_views(kind, "cuda", pinned)
    assert tp.run_copy_case("swap_blocks", views, PAIRS, tc.run, max_ctas=max_ctas) is None


@pytest.mark.gpu
@gpu
def test_gpu_forty_jobs_in_one_call_take_two_launches(monkeypatch):
    g = torch.Generator().manual_seed(3)
    views = []
    for n in range(40):  # layers of two block counts: every job skips by its own sides
        blocks = 6 if n % 2 else 5
        src = torch.randn(blocks, 2, 4, 8, generator=g).to(torch.bfloat16).cuda()
        views.append((src, torch.randn(6, 2, 4, 8, generator=g).to(torch.bfloat16).cuda()))
    calls = []
    real = nvrtc.launch
    monkeypatch.setattr(nvrtc, "launch", lambda *a: (calls.append(a), real(*a))[1])
    assert tp.run_copy_case("swap_blocks_multi_layer", views, PAIRS, tc.run) is None
    assert len(calls) == 2  # two geometries (block counts 5 and 6), 20 jobs each: one launch each


@pytest.mark.gpu
@gpu
def test_gpu_more_jobs_of_one_geometry_than_slots_take_two_launches(monkeypatch):
    views = [(torch.randn(6, 2, 4, 8, device="cuda").to(torch.float16),
              torch.randn(6, 2, 4, 8, device="cuda").to(torch.float16))
             for _ in range(tc.SLOTS + 8)]
    calls = []
    real = nvrtc.launch
    monkeypatch.setattr(nvrtc, "launch", lambda *a: (calls.append(a), real(*a))[1])
    assert tp.run_copy_case("swap_blocks_multi_layer", views, PAIRS, tc.run,
                            max_ctas=2) is None
    assert len(calls) == 2


def test_launchable_triggers_early_only_where_asked(monkeypatch):
    """A plan under an SM budget (``early_trigger`` False) loads the PDL twin built without the
    early trigger (nvrtc.PDL_NO_TRIGGER_MACRO); the two twins are cached apart."""
    asked = []
    monkeypatch.setattr(launch, "require_setup", lambda: None)
    monkeypatch.setattr(nvrtc, "load_kernels",
                        lambda source, name, macros, index, trigger=True:
                        (asked.append(trigger), ("plain", f"pdl-{trigger}"))[1])
    monkeypatch.setattr(tc, "LAUNCHES", launch.LaunchCache())
    assert tc._launchable("k", 0, False).pdl_kernel == "pdl-False"
    assert tc._launchable("k", 0, True).pdl_kernel == "pdl-True"
    assert tc._launchable("k", 0, False).pdl_kernel == "pdl-False"
    assert asked == [False, True]
    plan = tp.make_plan("relayout_kv_cache", [], torch.zeros(1, 2, dtype=torch.int32), 1,
                        torch.device("cpu"), 4)
    assert not plan.early_trigger
    assert dataclasses.replace(plan, max_ctas=None).early_trigger


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pinned", [None, "dst"])
def test_gpu_graph_capture_of_a_first_call_and_replay(monkeypatch, pinned):
    """The variant is first loaded inside the capture; replays read the mapping's new values."""
    monkeypatch.setattr(tc, "LAUNCHES", launch.LaunchCache())
    views = tp.copy_views("relayout", "cuda", pinned)
    (src, dst), = views
    mapping = tp.mapping_tensor(PAIRS, torch.int32, "cuda", strided=True)
    plan = tp.make_plan("relayout_kv_cache", [tp.copy_job(src, dst)], mapping, len(PAIRS),
                        src.device, 4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tc.run(plan)
    for new in ([(1, 2), (0, 0), (3, 3), (2, 9), (5, 4), (-3, 1)], PAIRS):
        want = tp.raw_oracle(views, new)
        mapping.copy_(tp.mapping_tensor(new, torch.int32, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(storage_bytes(dst).cpu(), storage_bytes(want[0]))


@pytest.mark.gpu
@gpu
def test_gpu_empty_mapping_writes_nothing():
    views = tp.copy_views("dense", "cuda")
    assert tp.run_copy_case("swap_blocks", views, [], tc.run) is None


# ------------------------------------------------------------------------------------------
# GPU: quantized pages
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format", ["fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mapping_dtype", [torch.int32, torch.int64])
def test_gpu_pages_match_the_torch_rules(direction, page_format, cache_dtype, mapping_dtype):
    case = tp.PageCase(direction, page_format, cache_dtype)
    assert tp.run_page_case(case, tc.run, mapping_dtype=mapping_dtype,
                            strided_mapping=mapping_dtype == torch.int32) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format,C,S", [("fp8_e4m3", 10, 2), ("fp8_e5m2", 40, 1),
                                             ("nvfp4", 64, 2), ("nvfp4", 16, 1)])
@pytest.mark.parametrize("max_ctas", [1, 3, None])
def test_gpu_pages_row_shapes_and_ctas(direction, page_format, C, S, max_ctas):
    case = tp.PageCase(direction, page_format, torch.bfloat16, C=C, S=S, N=3, Hc=2, Hp=2, K=2,
                       hc0=0, hp0=0, row_pad=0, pad=0, scale_shape="head")
    assert tp.run_page_case(case, tc.run, max_ctas=max_ctas) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format", ["fp8_e4m3", "nvfp4"])
def test_gpu_pages_more_layers_than_slots_and_pinned_pages(direction, page_format):
    case = tp.PageCase(direction, page_format, torch.float16, L=tc.SLOTS + 3, N=2, C=16, S=1,
                       pages_pinned=True, scale_shape="tensor")
    assert tp.run_page_case(case, tc.run, max_ctas=4) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format", ["fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,C,S", [(5, 64, 2), (16, 256, 2), (9, 128, 2), (10, 128, 1)])
@pytest.mark.parametrize("L", [2, 3])
@pytest.mark.parametrize("max_ctas", [3, None])
def test_gpu_aligned_pages_match_the_torch_rules(direction, page_format, cache_dtype, N, C, S,
                                                 L, max_ctas):
    """The aligned variants (dense caches, 16-byte aligned chunks; codes at 4*L*S = 8, 12, 16,
    24: ALIGN 8, 4, 16, 8): U = 1 and 2, items masked at a segment's end, their GPU build's
    fp8 quotient and NVFP4 rule."""
    case = tp.PageCase(direction, page_format, cache_dtype, L=L, S=S, N=N, C=C, pad=0,
                       row_pad=16, page_offset=32)
    caches, pages, scale = case.make("cpu")
    assert tc.page_align(case.page_job(caches, pages, scale)) > 0
    assert tp.run_page_case(case, tc.run, max_ctas=max_ctas) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("page_format", ["fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("scale_value", [1.0, 0.125, 3.0, 1e-30, 2.0 ** -101, 2.0 ** 101])
def test_gpu_pack_special_values(page_format, cache_dtype, aligned, scale_value):
    """Every fp8 value and tie (times sigma), saturation, +-inf, NaN, +-0, tiny values; sigma
    inside and outside [2^-100, 2^100] (fp8; nvfp4's contract stops there)."""
    if page_format == "nvfp4" and not 2.0 ** -100 <= scale_value <= 2.0 ** 100:
        pytest.skip("nvfp4 chunks of a sigma outside [2^-100, 2^100] are unspecified")
    case = tp.PageCase("pack", page_format, cache_dtype, L=2, S=2, N=16, C=64, Hc=2, Hp=2, K=2,
                       hc0=0, hp0=0, special=True, scale_value=scale_value,
                       scale_shape="tensor")
    if aligned:
        case = dataclasses.replace(case, pad=0, row_pad=16, page_offset=32)
    assert tp.run_page_case(case, tc.run) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("model", ["llama3-8b", "deepseek-v3"])
def test_gpu_pages_of_the_benchmark_shape(direction, page_format, model):
    """The benchmark's launches: 32 Llama-3-8B layers of 8 heads (ALIGN 16 / 8, U = 2), 61
    DeepSeek-V3 latent layers (ALIGN 4, U = 2), 6 blocks."""
    L, H, N, C, S = (32, 8, 16, 256, 2) if model == "llama3-8b" else (61, 1, 64, 576, 1)
    case = tp.PageCase(direction, page_format, torch.bfloat16, L=L, S=S, N=N, C=C, Hc=H,
                       Hp=H, K=H, hc0=0, hp0=0, num_blocks=6, num_pages=8, pad=0, row_pad=0,
                       page_offset=0, scale_shape="full",
                       pairs=((0, 7), (5, 0), (2, 3), (-1, 4), (3, 8), (1, 1)))
    assert tc.page_align(case.page_job(*case.make("cpu"))) > 0
    assert tp.run_page_case(case, tc.run) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("op", ["swap_blocks", "swap_blocks_multi_layer", "relayout_kv_cache",
                                "pack_kv_pages", "unpack_kv_pages"])
def test_gpu_sanitize_cases(op):
    """Each transfer op's memcheck cases pass without the memory checker too."""
    mod = importlib.import_module(f"tools.sanitize.{op}")
    for case_id, run in mod.cases():
        assert run() is None, case_id


@pytest.mark.parametrize("op", ["swap_blocks", "swap_blocks_multi_layer", "relayout_kv_cache",
                                "pack_kv_pages", "unpack_kv_pages"])
def test_sanitize_cases_are_listed(op):
    ids = [i for i, _ in importlib.import_module(f"tools.sanitize.{op}").cases()]
    assert ids and len(set(ids)) == len(ids)


def test_magic_division_constants():
    """transfer.cu's fdiv: floor(n * magic / 2^64) == n // d for n, d < 2^32."""
    import random
    rng = random.Random(5)
    for d in [1, 2, 3, 5, 7, 16, 125, 4096, 2**31, 2**32 - 1] + [rng.randrange(1, 2**32)
                                                                  for _ in range(200)]:
        m = tc.magic(d) % (1 << 64)
        assert -(1 << 63) <= tc.magic(d) < 1 << 63
        for n in [0, 1, d - 1, d, 2**32 - 1, (2**32 - 1) // d * d, rng.randrange(2**32)]:
            assert (n if m == 0 else (n * m) >> 64) == n // d, (n, d)


def test_copy_unroll_fills_a_warp_segment():
    """U is the largest power of two up to the most whose segment (32 * U vectors) the row fills:
    rows shorter than two warps' vectors take U = 1."""
    assert [tc.copy_unroll(n, 8) for n in (1, 32, 63, 64, 127, 128, 255, 256, 4096)] == \
        [1, 1, 1, 2, 2, 4, 4, 8, 8]
    assert tc.copy_unroll(4096, 2) == 2
    assert tc.copy_unroll(4096, 1) == 1


@needs_nvrtc
def test_copy_kernel_fits_1024_threads(tmp_path):
    """The copy kernel's launch bounds hold it to 64 registers a thread at every U and vector
    width, so TUNING's 1024-thread CTA launches (cuobjdump -res-usage of the sm_90 builds)."""
    sass = importlib.import_module("sass").cuobjdump_or_skip()
    import re
    import subprocess
    for vb in (1, 16):
        for u in (1, 2, 8):
            cubin, _ = tc.SOURCE.cubin("sm_90", tc.copy_name(vb, torch.int64, u), ())
            path = tmp_path / "k.cubin"
            path.write_bytes(cubin)
            out = subprocess.run([sass.cuobjdump(), "-res-usage", str(path)], capture_output=True,
                                 text=True, check=True).stdout
            regs = [int(r) for r in re.findall(r"REG:(\d+)", out)]
            assert regs and max(regs) <= 64, (vb, u, regs)
    assert tc.TUNING.copy_threads * 64 <= 65536


@needs_nvrtc
def test_copy_rows_kernel_fits_1024_threads_without_spills(tmp_path):
    """The rows kernel at every U the launcher picks (up to ROWS_MOST) and every LANES: at most
    64 registers and no stack (at U = 8 a step's rows that leave row 0's block are moved two at
    a time: with four, ptxas spilled)."""
    sass = importlib.import_module("sass").cuobjdump_or_skip()
    import re
    import subprocess
    for vb in (1, 4, 16):
        for dt in (torch.int32, torch.int64):
            for u in range(1, tc.ROWS_MOST + 1):
                if u & (u - 1):
                    continue
                for lanes in (1, 2, 4, 8, 16, 32):
                    cubin, _ = tc.SOURCE.cubin("sm_90", tc.copy_name(vb, dt, u, lanes), ())
                    path = tmp_path / "k.cubin"
                    path.write_bytes(cubin)
                    out = subprocess.run([sass.cuobjdump(), "-res-usage", str(path)],
                                         capture_output=True, text=True, check=True).stdout
                    regs = [int(r) for r in re.findall(r"REG:(\d+)", out)]
                    stack = [int(r) for r in re.findall(r"STACK:(\d+)", out)]
                    assert regs and max(regs) <= 64 and stack == [0], (vb, dt, u, lanes, out)


def test_copy_lanes_group_short_rows():
    """Rows of at most 32 vectors take the rows kernel with the least power of two lanes that
    holds them; longer rows the segments (0)."""
    assert [tc.copy_lanes(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 64, 4096)] == \
        [1, 2, 4, 8, 8, 16, 16, 32, 32, 32, 0, 0, 0]
    assert [tc.copy_rows_unroll(m) for m in (1, 2, 3, 4, 8, 16)] == [1, 2, 2, 4, 8, 8]
    assert tc.ROWS_MOST == 8


@pytest.mark.parametrize("row_bytes,name", [
    (256, "transfer_copy_rows_kernel<16, int, 2, 16>"),    # raw pack/unpack: E * es = 256 B
    (512, "transfer_copy_rows_kernel<16, int, 2, 32>"),    # relayout LBNHC -> LBHNC rows
    (1024, "transfer_copy_kernel<16, int, 2>"),            # 64 vectors: segments of 2 loads
    (65536, "transfer_copy_kernel<16, int, 2>"),           # swap's whole blocks
    (48, "transfer_copy_rows_kernel<16, int, 2, 4>"),
])
def test_copy_calls_pick_the_rows_kernel_for_short_rows(row_bytes, name):
    """copy_calls (what run launches): the variant by the rows' vectors, the units of work (rows
    for the rows kernel: 32 / LANES * U a warp's step; warp segments else) and the arguments."""
    src = torch.zeros(5, 2, 3, row_bytes, dtype=torch.uint8)
    jobs = [tp.copy_job(src, src.clone()) for _ in range(3)]
    mapping = tp.mapping_tensor(PAIRS, torch.int32, "cpu")
    plan = tp.make_plan("swap_blocks_multi_layer", jobs, mapping, len(PAIRS), torch.device("cuda"))
    # CPU tensors stand for device ones: their sides count as host memory, whose U is set here
    # to the device's.
    tuning = tc.TransferTuning(loads_in_flight_host=tc.TUNING.loads_in_flight,
                               host_read_rows=tc.TUNING.loads_in_flight)
    (c,) = tc.copy_calls(plan, tuning)
    assert c.name == name and c.threads == 1024
    nvec = row_bytes // 16
    rows = 3 * len(PAIRS) * 2 * 3
    lanes = tc.copy_lanes(nvec)
    if lanes:
        assert (c.work, c.per_warp) == (rows, 32 // lanes * 2)
        assert c.args[-6] == 1 and c.args[-1] == 1  # segs; pair-major (one source)
    else:
        segs = -(-nvec // 64)
        assert (c.work, c.per_warp) == (rows * segs, 1) and c.args[-5] == segs
    assert c.args[0] == mapping.data_ptr() and c.args[4:6] == (jobs[0].src.ptr, jobs[0].dst.ptr)
    njobs = 4 + 2 * tc.SLOTS  # after the mapping's 4 arguments and the slots
    assert c.args[njobs] == 3 and c.args[njobs + 13] == nvec  # njobs, nvec


def test_half_rows():
    """halve_rows: dense rows of 32 vectors as two jobs of 16-vector half rows, a job's halves
    together, the second's pointers half a row on; None for other rows, where the halves would
    not fit one launch, and where the tuning turns it off."""
    caches = [torch.zeros(6, 2, 3, 512, dtype=torch.uint8) for _ in range(3)]
    (cl,) = tc.copy_launches(tuple(tp.copy_job(c, c.clone()) for c in caches))
    assert (cl.vb, cl.geometry[12:]) == (16, (32, 1))
    h = tc.halve_rows(cl)
    assert h.geometry == (*cl.geometry[:12], 16, 1) and h.vectors_per_pair == 2 * 3 * 16
    assert h.pointers == tuple(q for s, d in cl.pointers for q in ((s, d), (s + 256, d + 256)))
    assert tc.halve_rows(cl, tc.TransferTuning(half_rows=0)) is None
    assert tc.halve_rows(cl, tc.TransferTuning(jobs_per_launch=4)) is None  # 6 jobs > 4
    short = [torch.zeros(6, 2, 3, 256, dtype=torch.uint8) for _ in range(2)]
    (cs,) = tc.copy_launches(tuple(tp.copy_job(c, c.clone()) for c in short))
    assert tc.halve_rows(cs) is None  # 16 vectors
    many = [torch.zeros(1, 1, 1, 512, dtype=torch.uint8) for _ in range(tc.SLOTS // 2 + 1)]
    (cm,) = tc.copy_launches(tuple(tp.copy_job(c, c.clone()) for c in many))
    assert tc.halve_rows(cm) is None


def test_rows_order_by_where_the_jobs_lie():
    """pair_major (the rows launch's order): pair-major where the jobs lie inside one block of a
    side (layers of a page-first buffer on either side), job-major where every job has its
    allocations (per-layer caches), for one job, and as a tuning forces it; copy_calls passes
    the order last and the inner count's fdiv constant (njobs where pair-major) before it."""
    caches = [torch.zeros(6, 2, 3, 64, dtype=torch.uint8) for _ in range(4)]
    buf = torch.zeros(7, 4, 2, 3, 64, dtype=torch.uint8)  # [blocks, L, H, N, C]

    def launch_of(pairs):
        (cl,) = tc.copy_launches(tuple(tp.copy_job(s, d) for s, d in pairs))
        return cl

    into_buffer = launch_of([(c, buf[:6, n]) for n, c in enumerate(caches)])
    from_buffer = launch_of([(buf[:6, n], c) for n, c in enumerate(caches)])
    apart = launch_of([(c, c.clone()) for c in caches])
    one = launch_of([(caches[0], buf[:6, 0])])
    assert tc.pair_major(into_buffer) and tc.pair_major(from_buffer)
    assert not tc.pair_major(apart) and not tc.pair_major(one)
    assert tc.pair_major(apart, "pairs") and not tc.pair_major(into_buffer, "jobs")
    mapping = tp.mapping_tensor(PAIRS, torch.int32, "cpu")
    for pairs, order in (([(c, buf[:6, n]) for n, c in enumerate(caches)], 1),
                         ([(c, c.clone()) for c in caches], 0)):
        plan = tp.make_plan("relayout_kv_cache", [tp.copy_job(s, d) for s, d in pairs], mapping,
                            len(PAIRS), torch.device("cuda"))
        (c,) = tc.copy_calls(plan, tc.TransferTuning(loads_in_flight_host=2, host_read_rows=2))
        assert c.name.startswith("transfer_copy_rows_kernel<")
        assert c.args[-1] == order
        assert c.args[-2] == tc.magic(4 if order else len(PAIRS))


@pytest.mark.parametrize("src_on, dst_on, peer, u", [
    ("meta", "meta", False, 2),   # device to device: loads_in_flight
    ("meta", "cpu", False, 8),    # d2h: loads_in_flight_host
    ("cpu", "meta", False, 4),    # h2d: host_read_rows
    ("meta", "meta", True, 8),    # a peer's source: loads_in_flight_host
])
def test_rows_launches_take_u_by_where_their_sides_are(src_on, dst_on, peer, u):
    """A rows launch's U (rows a lane loads before its stores): the device's, the remote sides',
    or the smaller one of reads from pinned host memory (meta tensors stand for device ones)."""
    src = torch.empty(5, 2, 16, 256, dtype=torch.uint8, device=src_on)
    dst = torch.empty(5, 2, 16, 256, dtype=torch.uint8, device=dst_on)
    mapping = tp.mapping_tensor(PAIRS, torch.int32, "cpu")
    plan = tp.make_plan("swap_blocks_multi_layer", [tp.copy_job(src, dst)], mapping, len(PAIRS),
                        torch.device("cuda"))
    if peer:
        plan = dataclasses.replace(plan, peer=torch.device("cuda", 1))
    (c,) = tc.copy_calls(plan)
    assert c.name == tc.copy_name(16, torch.int32, u, 16)
    assert (tc.TUNING.loads_in_flight, tc.TUNING.loads_in_flight_host,
            tc.TUNING.host_read_rows) == (2, 8, 4)


def test_copy_threads_share_a_host_budget():
    """Copies that read device memory and write pinned host memory share 512 threads over the
    budget's CTAs, at least 128 each (room left on their SMs); the others (device buffers, reads
    of host memory) take whole 1024-thread CTAs."""
    assert tc.copy_threads(False, 4) == tc.TUNING.copy_threads == 1024
    assert [tc.copy_threads(True, m) for m in (1, 2, 3, 4, 8, None)] == [512, 256, 160, 128,
                                                                          128, 128]


def test_copy_calls_read_a_peer_source_with_the_remote_unroll(monkeypatch):
    """A peer source (another GPU, read over NVLink a round trip away) takes the loads in flight
    of a pinned host side, not the device copy's: the unroll compiled into the launch differs
    only by ``plan.peer``."""
    monkeypatch.setattr(Side, "on_host", property(lambda self: False))  # stand-ins as GPU sides
    src = torch.zeros(5, 2, 3, 65536, dtype=torch.uint8)
    jobs = [tp.copy_job(src, src.clone())]
    mapping = tp.mapping_tensor(PAIRS, torch.int32, "cpu")
    plan = tp.make_plan("swap_blocks_multi_layer", jobs, mapping, len(PAIRS), torch.device("cuda", 1))
    tuning = tc.TransferTuning(loads_in_flight=1, loads_in_flight_host=4)
    (local,) = tc.copy_calls(plan, tuning)
    (peer,) = tc.copy_calls(dataclasses.replace(plan, peer=torch.device("cuda", 0)), tuning)
    assert local.name == "transfer_copy_kernel<16, int, 1>"
    assert peer.name == "transfer_copy_kernel<16, int, 4>"
