"""The kernel cache on disk (kvwrite.kernels.nvrtc): a build's cubin is stored once and read back
in place of a compile, keyed by everything that goes into the build; entries that do not check out
are compiled again; KVWRITE_KERNEL_CACHE=0 turns it off. On the GPU, a new process launches the
kernels from the cache without compiling and writes the reference's bytes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("cuda.core")

from kvwrite.kernels import nvrtc  # noqa: E402
from kvwrite.ops.rotary_embedding import cuda_impl as rope_cuda  # noqa: E402

NAME = rope_cuda.all_kernel_names()[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWRITE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVWRITE_KERNEL_CACHE", raising=False)
    return tmp_path / "nvrtc"


def _compiles(monkeypatch) -> list:
    """Record every NVRTC compile of KernelSource (and still compile)."""
    calls = []
    real = nvrtc.KernelSource.compile

    def counting(self, arch, names, **kw):
        calls.append((arch, names, kw.get("macros")))
        return real(self, arch, names, **kw)

    monkeypatch.setattr(nvrtc.KernelSource, "compile", counting)
    return calls


def test_a_build_is_compiled_once_and_then_read_from_the_cache(cache, monkeypatch):
    calls = _compiles(monkeypatch)
    cubin, mangled = rope_cuda.SOURCE.cubin("sm_90", NAME)
    assert len(calls) == 1 and len(list(cache.iterdir())) == 1
    assert cubin[:4] == b"\x7fELF" and mangled is not None and mangled.startswith(b"_Z")
    again = nvrtc.KernelSource(rope_cuda.SOURCE.package, rope_cuda.SOURCE.filename,
                               rope_cuda.SOURCE.program_name)  # a new process's source object
    assert again.cubin("sm_90", NAME) == (cubin, mangled) and len(calls) == 1
    # Another macro set, another architecture: other builds, other entries.
    pdl, _ = rope_cuda.SOURCE.cubin("sm_90", NAME, (nvrtc.PDL_MACRO,))
    old, _ = rope_cuda.SOURCE.cubin("sm_80", NAME)
    assert len(calls) == 3 and len(list(cache.iterdir())) == 3
    assert len({cubin, pdl, old}) == 3


def test_the_key_changes_with_the_source_text(cache, monkeypatch):
    calls = _compiles(monkeypatch)
    src = rope_cuda.SOURCE
    src.cubin("sm_90", NAME)
    other = nvrtc.KernelSource(src.package, src.filename, src.program_name)
    other.__dict__["text"] = src.text + "\n// edited\n"  # the cached_property's slot
    other.cubin("sm_90", NAME)
    assert len(calls) == 2 and len(list(cache.iterdir())) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "magic"])
def test_an_entry_that_does_not_check_out_is_compiled_again(cache, monkeypatch, damage):
    cubin, mangled = rope_cuda.SOURCE.cubin("sm_90", NAME)
    (entry,) = cache.iterdir()
    data = bytearray(entry.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip":
        data[-100] ^= 0xFF
    elif damage == "empty":
        data = bytearray()
    else:
        data[0] ^= 0xFF
    entry.write_bytes(bytes(data))
    calls = _compiles(monkeypatch)
    assert rope_cuda.SOURCE.cubin("sm_90", NAME) == (cubin, mangled)
    assert len(calls) == 1
    assert rope_cuda.SOURCE.cubin("sm_90", NAME) == (cubin, mangled) and len(calls) == 1


def test_switched_off_or_unwritable_it_compiles_every_time(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("KVWRITE_KERNEL_CACHE", "0")
    assert nvrtc.kernel_cache_dir() is None
    calls = _compiles(monkeypatch)
    first = rope_cuda.SOURCE.cubin("sm_90", NAME)
    assert rope_cuda.SOURCE.cubin("sm_90", NAME) == first and len(calls) == 2
    assert not cache.exists()
    # A cache directory that cannot be created (its parent is a file): compiled, no error.
    monkeypatch.delenv("KVWRITE_KERNEL_CACHE")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KVWRITE_CACHE_DIR", str(blocker))
    assert rope_cuda.SOURCE.cubin("sm_90", NAME) == first and len(calls) == 3


def test_the_default_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("KVWRITE_CACHE_DIR", raising=False)
    monkeypatch.delenv("KVWRITE_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert nvrtc.kernel_cache_dir() == os.path.join(str(tmp_path), "kvwrite", "nvrtc")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert nvrtc.kernel_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "kvwrite",
                                                    "nvrtc")


_GPU_SCRIPT = r"""
import sys, torch, kvwrite
from kvwrite.kernels import nvrtc
from kvwrite.testing.rope import cos_sin_table
if sys.argv[1] == "no-compile":
    def refuse(*a, **k):
        raise AssertionError("compiled although the cache holds the build")
    nvrtc.KernelSource.compile = refuse
g = torch.Generator(device="cuda").manual_seed(0)
qkv = torch.randn(64, 48, 128, device="cuda", generator=g).to(torch.bfloat16)
pos = torch.randint(0, 4096, (64,), device="cuda", generator=g)
slots = torch.randperm(256 * 16, device="cuda", generator=g)[:64]
table = cos_sin_table(4096, 128, torch.float32, device="cuda")
out = {}
for impl in ("torch", "cuda"):
    x = qkv.clone()
    kc = torch.zeros(256, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kvwrite.fused_rope_and_reshape_cache_flash(x[:, :32], x[:, 32:40], x[:, 40:], pos, table,
                                               True, kc, vc, slots, None, None, "auto",
                                               implementation=impl)
    out[impl] = (x, kc, vc)
assert all(torch.equal(a, b) for a, b in zip(out["torch"], out["cuda"]))
print("ok")
"""


@pytest.mark.gpu
def test_a_new_process_launches_kernels_from_the_cache_without_compiling(tmp_path):
    if nvrtc.setup_reason() is not None:
        pytest.skip(nvrtc.setup_reason())
    env = {k: v for k, v in os.environ.items() if k != "KVWRITE_KERNEL_CACHE"}
    env["KVWRITE_CACHE_DIR"] = str(tmp_path)
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    for mode in ("compile", "no-compile"):
        done = subprocess.run([sys.executable, "-c", _GPU_SCRIPT, mode], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "ok", (mode, done.stderr[-3000:])
    assert len(list((tmp_path / "nvrtc").iterdir())) >= 2  # the plain and the PDL build
