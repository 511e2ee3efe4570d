"""Programmatic dependent launch (kernels/nvrtc.py; kvw/common.cuh's KVW_PDL_ENTRY): every CUDA
kernel's PDL build waits for the kernels before it (ACQBULK) before its first memory access and
lets the next kernel be scheduled (PREEXIT), the plain build does neither; the switch
(KVWRITE_PDL, use_pdl, --no-pdl); on the GPU, a PDL call reads what the kernel just before it
wrote, eagerly and in a CUDA graph, and (after a writer that writes late) a call that does not wait
reads the rows before they are written."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import kvwrite
import sass as sass_tools
from kvwrite.layouts import KVAlloc, Layout, allocate_kv_cache
from kvwrite.testing.rope import cos_sin_table
from sass import MEMORY_OPS
from test_bench import CPU_RUNS

OPS = ["reshape_and_cache_flash", "rotary_embedding", "fused_rope_and_reshape_cache_flash",
       "concat_and_cache_mla"]


def _cuda_impl(op: str):
    pytest.importorskip("cuda.core")
    import importlib

    return importlib.import_module(f"kvwrite.ops.{op}.cuda_impl")


@pytest.mark.parametrize("op", OPS)
def test_pdl_builds_wait_before_any_memory_access(op, tmp_path):
    """sm_90: in every variant's PDL build PREEXIT and ACQBULK come before the first global load
    or store (the fused op's large-call build, without the trigger: ACQBULK and no PREEXIT); the
    plain build has neither. sm_80 (no griddepcontrol): the PDL build compiles to the plain one."""
    mod = _cuda_impl(op)
    from kvwrite.kernels import nvrtc

    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton wheel) to read the SASS")
    names = mod.all_kernel_names()
    pdl, _ = mod.SOURCE.compile("sm_90", names, macros=(nvrtc.PDL_MACRO,))
    funcs = sass_tools.functions(sass_tools.dump_sass(bytes(pdl.code), tmp_path))
    assert len(funcs) == len(set(names)), (len(funcs), len(set(names)))
    sass_tools.assert_waits_first(funcs)
    if op == "fused_rope_and_reshape_cache_flash":
        wait_only, _ = mod.SOURCE.compile("sm_90", names, macros=(nvrtc.PDL_MACRO,
                                                                  nvrtc.PDL_NO_TRIGGER_MACRO))
        sass_tools.assert_waits_first(sass_tools.functions(
            sass_tools.dump_sass(bytes(wait_only.code), tmp_path)), trigger=False)
    plain, _ = mod.SOURCE.compile("sm_90", names[:8])
    sass_tools.assert_no_pdl(sass_tools.dump_sass(bytes(plain.code), tmp_path))
    old, _ = mod.SOURCE.compile("sm_80", names[:4], macros=(nvrtc.PDL_MACRO,))
    text = sass_tools.dump_sass(bytes(old.code), tmp_path)
    assert "ACQBULK" not in text and "PREEXIT" not in text and "LDG" in text


def test_use_pdl_switches_it_and_the_environment_sets_it():
    pytest.importorskip("cuda.core")
    from kvwrite.kernels import nvrtc

    before = nvrtc.pdl_on()
    try:
        nvrtc.use_pdl(False)
        assert not nvrtc.pdl_on()
        nvrtc.use_pdl(True)
        assert nvrtc.pdl_on()
    finally:
        nvrtc.use_pdl(before)
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    for value, want in (("0", "False"), ("1", "True"), (None, "True")):
        env = {k: v for k, v in os.environ.items() if k != "KVWRITE_PDL"}
        if value is not None:
            env["KVWRITE_PDL"] = value
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
        out = subprocess.run([sys.executable, "-c", "from kvwrite.kernels import nvrtc; "
                              "print(nvrtc.pdl_on())"], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == want, (value, out)


@pytest.mark.parametrize("sub", ["rope", "mla", "write"])
def test_bench_no_pdl_says_so_in_the_header(sub, capsys):
    pytest.importorskip("cuda.core")
    from kvwrite.bench import cli
    from kvwrite.kernels import nvrtc

    argv = CPU_RUNS[sub]
    before = nvrtc.pdl_on()
    try:
        assert cli.main(argv + ["--no-pdl"]) == 0
        assert "# launch: programmatic dependent launch off" in capsys.readouterr().out
        assert not nvrtc.pdl_on()
    finally:
        nvrtc.use_pdl(before)


# --- on the GPU ----------------------------------------------------------------------------------

T_BIG, N = 8192, 64  # the writing call's tokens (many waves of CTAs); the reading call's


def _setup(seed: int):
    """A qkv tensor [T_BIG, 64, 128] (32 query, 8 key, 8 value heads and 16 more), positions,
    tables, caches and slots for the reading calls (the last N tokens)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(T_BIG, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    pos_big = torch.randint(0, 4096, (T_BIG,), device="cuda", generator=g)
    pos = torch.randint(0, 4096, (N,), device="cuda", generator=g)
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:N]
    kc, vc = allocate_kv_cache(64, 16, 8, 128, torch.bfloat16, Layout.NHD, KVAlloc.INTERLEAVED,
                               "cuda")
    kc.zero_()
    vc.zero_()
    mla = kvwrite.create_mla_cache(64, 16, 512, 64, "auto", torch.bfloat16, device="cuda")
    mla.zero_()
    return {"qkv": qkv, "pos_big": pos_big, "pos": pos, "slots": slots, "kc": kc, "vc": vc,
            "mla": mla}


def _sequence(op: str, s: dict, impl: str, table: torch.Tensor) -> None:
    """A large rotary call that rotates every token's rows of qkv in place, then ``op`` reading
    the last N tokens' rows: what the second reads was written by the first, the kernel just
    before it in the stream (which lets its successor be scheduled as soon as it starts)."""
    qkv = s["qkv"]
    kvwrite.rotary_embedding(s["pos_big"], qkv[:, :32], qkv[:, 32:40], 128, table, True,
                             implementation=impl)
    last = qkv[-N:]
    if op == "rotary_embedding":
        kvwrite.rotary_embedding(s["pos"], last[:, :32], last[:, 32:40], 128, table, True,
                                 implementation=impl)
    elif op == "reshape_and_cache_flash":
        kvwrite.reshape_and_cache_flash(last[:, 32:40], last[:, 40:48], s["kc"], s["vc"],
                                        s["slots"], "auto", implementation=impl)
    elif op == "fused_rope_and_reshape_cache_flash":
        kvwrite.fused_rope_and_reshape_cache_flash(
            last[:, :32], last[:, 32:40], last[:, 40:48], s["pos"], table, True, s["kc"], s["vc"],
            s["slots"], None, None, "auto", implementation=impl)
    else:
        flat = last.reshape(N, 64 * 128)
        kvwrite.concat_and_cache_mla(flat[:, :512], flat[:, 4096:4160], s["mla"], s["slots"],
                                     "auto", implementation=impl)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
               for k in ("qkv", "kc", "vc", "mla"))


def _skip_without_pdl(impl: str = "cuda"):
    from kvwrite.kernels import nvrtc, triton_support

    if nvrtc.setup_reason() is not None:
        pytest.skip(nvrtc.setup_reason())
    if not nvrtc.pdl_capable(torch.cuda.current_device()) or not nvrtc.pdl_on():
        pytest.skip("programmatic dependent launch needs compute capability 9.0 (and is on)")
    if impl == "triton" and not triton_support._pdl_device(torch.cuda.current_device()):
        pytest.skip("this Triton has no grid dependency control (gdc_wait)")


@pytest.mark.gpu
@pytest.mark.parametrize("launch", ["pdl-eager", "pdl-graph", "plain-eager", "plain-graph"])
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("op", OPS)
def test_call_reads_what_the_kernel_before_it_wrote(op, impl, launch):
    """With programmatic dependent launch (the default) and without (the plain builds)."""
    from kvwrite.kernels import nvrtc

    _skip_without_pdl(impl)
    table = cos_sin_table(4096, 128, torch.float32, device="cuda")
    want = _setup(0)
    _sequence(op, want, "torch", table)
    got = _setup(0)
    try:
        nvrtc.use_pdl(launch.startswith("pdl"))
        if launch.endswith("graph"):
            _sequence(op, _setup(1), impl, table)  # compiles the variants outside the capture
            live = _setup(1)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                _sequence(op, live, impl, table)
            for k, t in got.items():
                live[k].copy_(t)
            g.replay()
            got = live
        else:
            _sequence(op, got, impl, table)
        torch.cuda.synchronize()
    finally:
        nvrtc.use_pdl(True)
    assert _same(got, want)


# A writer that lets its successor be scheduled at once, then waits ~100 us before it writes: a
# successor that reads without waiting for it reads the rows as they were, every time.
_LATE_WRITER = r"""
extern "C" __global__ void kvw_test_late_copy(const unsigned int* src, unsigned int* dst,
                                              long long n, long long delay_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < static_cast<unsigned long long>(delay_ns));
  for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    dst[i] = src[i];
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("impl,waits", [("cuda", True), ("triton", True), ("cuda", False)],
                         ids=["cuda-pdl-build", "triton-pdl-build", "cuda-build-without-the-wait"])
def test_pdl_call_after_a_late_writer(impl, waits):
    """A writer triggers its successor at once and writes the rows 100 us later; a rotary call
    launched with PDL right after it reads those rows. The PDL builds (cuda and Triton) wait and
    rotate the written rows; launched the same way, the cuda plain build (no KVW_PDL_ENTRY) reads
    them before they are written, so the check fails for a call that does not wait
    (deterministically)."""
    _skip_without_pdl(impl)
    from kvwrite.kernels import nvrtc
    from kvwrite.ops.rotary_embedding import cuda_impl

    table = cos_sin_table(4096, 128, torch.float32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    src = torch.randn(N, 40, 128, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (N,), device="cuda", generator=g)
    want = src.clone()
    kvwrite.rotary_embedding(pos, want[:, :32], want[:, 32:], 128, table, True,
                             implementation="torch")
    index = torch.cuda.current_device()
    arch, _ = nvrtc.device_arch(index)
    obj, _ = cuda_impl.SOURCE.compile(arch, "kvw_test_late_copy", source=_LATE_WRITER)
    writer = obj.get_kernel("kvw_test_late_copy")
    rows = torch.zeros_like(src)
    # The writer's first launch loads its module (lazily), which must not fall between the two.
    nvrtc.launch(index, nvrtc.launch_config(1, 1, 256, 1), writer, src.data_ptr(),
                 rows.data_ptr(), src.numel() // 2, 0)
    kvwrite.rotary_embedding(pos, rows[:, :32], rows[:, 32:], 128, table, True,
                             implementation=impl)  # compiles the kernel, creates the launchable
    saved = dict(cuda_impl.LAUNCHES)
    try:
        if not waits:
            for key, lau in saved.items():
                cuda_impl.LAUNCHES[key] = dataclasses.replace(lau, pdl_kernel=lau.kernel)
            # The plain build's first launch loads it (lazily), which must not fall between the
            # two either.
            kvwrite.rotary_embedding(pos, rows[:, :32], rows[:, 32:], 128, table, True,
                                     implementation=impl)
        rows.zero_()
        torch.cuda.synchronize()
        # A spin of ~10 ms first, so that the writer and the call are both queued before the
        # writer starts (the call's host-side work alone can outlast the writer's delay).
        torch.cuda._sleep(20_000_000)
        nvrtc.launch(index, nvrtc.launch_config(1, 1, 256, 1), writer, src.data_ptr(),
                     rows.data_ptr(), src.numel() // 2, 100_000)
        kvwrite.rotary_embedding(pos, rows[:, :32], rows[:, 32:], 128, table, True,
                                 implementation=impl)
        torch.cuda.synchronize()
    finally:
        cuda_impl.LAUNCHES.clear()
        cuda_impl.LAUNCHES.update(saved)
    # Without the wait the call rotated the zeros and the writer then stored src unrotated.
    assert torch.equal(rows.view(torch.int16), want.view(torch.int16)) == waits


# The builds the ops compile at run time (call-signature macros included), read back from the
# kernel cache: ptxas may hoist a read-only load (LDG.CONSTANT) above the wait, which a build of
# another signature than test_pdl_builds_wait_before_any_memory_access compiles could show.
_RUNTIME_SCRIPT = r"""
import torch, kvwrite
from kvwrite.testing.rope import cos_sin_table
g = torch.Generator(device="cuda").manual_seed(0)
table = cos_sin_table(4096, 128, torch.float32, device="cuda")
scale = torch.tensor([0.05], device="cuda")
for T in (1, 16, 4096):
    qkv = torch.randn(T, 48, 128, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (T,), device="cuda", generator=g)
    slots = torch.randperm(1024 * 16, device="cuda", generator=g)[:T]
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    for kv, dt in (("auto", torch.bfloat16), ("fp8", torch.uint8)):
        sc = None if kv == "auto" else scale
        for shape in ((1024, 16, 8, 128), (1024, 8, 16, 128)):  # NHD, HND
            kc = torch.zeros(shape, device="cuda", dtype=dt)
            vc = torch.zeros_like(kc)
            if shape[1] == 8:
                kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
            kvwrite.reshape_and_cache_flash(k, v, kc, vc, slots, kv, sc, sc, implementation="cuda")
            kvwrite.fused_rope_and_reshape_cache_flash(q, k, v, pos, table, True, kc, vc, slots, sc,
                                                       sc, kv, implementation="cuda")
    kvwrite.rotary_embedding(pos, q, k, 128, table, True, implementation="cuda")
    flat = torch.randn(T, 576, device="cuda", generator=g).to(torch.bfloat16)
    for mode in ("auto", "fp8", "fp8_ds_mla"):
        cache = kvwrite.create_mla_cache(1024, 16, 512, 64, mode, torch.bfloat16, device="cuda")
        kvwrite.concat_and_cache_mla(flat[:, :512], flat[:, 512:], cache, slots, mode,
                                     None if mode == "auto" else scale, implementation="cuda")
torch.cuda.synchronize()
print("ok")
"""


@pytest.mark.gpu
def test_runtime_pdl_builds_wait_before_any_memory_access(tmp_path):
    """Every op's cuda builds as compiled for real calls (small and large, auto and fp8, NHD and
    HND, the MLA modes), from a fresh kernel cache: in each PDL build no global load or store
    comes before the wait (ACQBULK)."""
    _skip_without_pdl()
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton wheel) to read the SASS")
    from kvwrite.kernels import nvrtc

    env = {k: v for k, v in os.environ.items() if k not in ("KVWRITE_KERNEL_CACHE", "KVWRITE_PDL")}
    env["KVWRITE_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                         env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _RUNTIME_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    waiting, early = [], []
    for entry in sorted((tmp_path / "nvrtc").iterdir()):
        cubin, _ = nvrtc._read_entry(str(entry))
        for name, ops in sass_tools.functions(sass_tools.dump_sass(cubin, tmp_path)).items():
            if "ACQBULK" in ops:
                waiting.append(name)
                wait = ops.index("ACQBULK")
                early += [(name, o) for o in ops[:wait] if o.startswith(MEMORY_OPS)]
    # The PDL builds of every op's kernels were compiled and read back.
    for kernel in ("reshape_and_cache_flash_kernel", "rotary_embedding_kernel",
                   "fused_rope_cache_kernel", "concat_and_cache_mla_kernel",
                   "concat_and_cache_ds_mla_kernel"):
        assert any(kernel in name for name in waiting), (kernel, waiting)
    assert early == []
