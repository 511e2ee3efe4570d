"""kvwrite.kernels.launch, what every op's CUDA launcher shares (CPU): the host-side alignment
and shift helpers, the PDL policy base of the tuning classes, the launch record's choice of
build, and that no launcher reaches into another op for a private name."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib

import pytest

from kvwrite.kernels import gather_cuda, launch, nvrtc

OPS = pathlib.Path(launch.__file__).parents[1] / "ops"
CUDA_IMPLS = sorted(p.parent.name for p in OPS.glob("*/cuda_impl.py"))


def test_log2_or_minus_1_is_the_shift_of_powers_of_two_only():
    for n in range(-5, 2050):
        want = next((k for k in range(12) if n == 1 << k), -1)
        assert launch.log2_or_minus_1(n) == want, n


@pytest.mark.parametrize("values, most, want", [
    ([], 16, 16), ([0], 16, 16), ([48, 64], 16, 16), ([24], 16, 8), ([6, 16], 16, 2),
    ([7], 16, 1), ([0x1000, 0x20], 8, 8), ([12], 8, 4), ([3], 8, 1)])
def test_align_is_the_largest_power_of_two_up_to_most_dividing_every_value(values, most, want):
    assert launch.align(values, most) == want
    assert all(v % want == 0 for v in values) and want <= most


def test_aligned_caps_the_access_at_16_bytes():
    assert launch.aligned(48, 16) and launch.aligned(48, 32) and not launch.aligned(40, 16)
    assert launch.aligned(40, 8) and not launch.aligned(2, 4) and launch.aligned(1, 1)


def _tuning_classes():
    out = [gather_cuda.CudaTuning]
    for name in CUDA_IMPLS:
        mod = importlib.import_module(f"kvwrite.ops.{name}.cuda_impl")
        if hasattr(mod, "CudaTuning") and mod.CudaTuning not in out:
            out.append(mod.CudaTuning)
    return out


@pytest.mark.parametrize("cls", _tuning_classes(), ids=lambda c: c.__module__)
def test_every_cuda_tuning_takes_the_pdl_policy_and_keeps_identity_hashing(cls):
    assert issubclass(cls, launch.PdlPolicy)
    names = [f.name for f in dataclasses.fields(cls)]
    assert names.count("pdl_max_ctas") == 1
    a, b = cls(), cls()
    assert a.pdl_max_ctas == 1 << 30
    # eq=False: two tunings with the same fields are two launch-cache keys; hashing reads none.
    assert a != b and a == a and hash(a) == object.__hash__(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.pdl_max_ctas = 0
    assert dataclasses.replace(a, pdl_max_ctas=7).pdl_max_ctas == 7


def test_launchable_picks_the_pdl_twin_up_to_max_ctas_while_pdl_is_on():
    lau = launch.Launchable("plain", "twin", 0, (1, 2))
    was = nvrtc.pdl_on()
    try:
        nvrtc.use_pdl(True)
        assert lau.pick(8, 8) == ("twin", True)
        assert lau.pick(9, 8) == ("plain", False)
        nvrtc.use_pdl(False)
        assert lau.pick(1, 8) == ("plain", False)
    finally:
        nvrtc.use_pdl(was)
    assert launch.Launchable("plain", None, 0, ()).pick(1, 1 << 30) == ("plain", False)


@pytest.mark.parametrize("name", CUDA_IMPLS)
def test_no_cuda_launcher_imports_another_ops_private_name(name):
    tree = ast.parse((OPS / name / "cuda_impl.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module:
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{name}/cuda_impl.py imports {private} from {node.module}"


@pytest.mark.parametrize("name", CUDA_IMPLS)
def test_every_cuda_launcher_caches_its_launchables_in_a_launch_cache(name):
    mod = importlib.import_module(f"kvwrite.ops.{name}.cuda_impl")
    assert isinstance(mod.LAUNCHES, launch.LaunchCache)
    assert not hasattr(mod, "_LAUNCHABLES") and not hasattr(mod, "_Launchable")
