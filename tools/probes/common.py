"""What the probes share: the timer, the copy bandwidth, point inputs from the workload model,
tuning variants (``--set``), the probes' minimal kernels, and the empty-kernel floors.

Timer (:func:`time_call`): :func:`kvwrite.bench.timing.time_device` with ``CALLS`` calls captured
in one CUDA graph, CUDA events around each replay, the median per call over ``replays`` replays,
hot L2 (the same inputs every call): the method of the vLLM figures the docs quote.

Variants: ``--set IMPL.FIELD=V1|V2`` names a field of an implementation's tuning dataclass
(``cuda``: :class:`~kvwrite.ops.reshape_and_cache_flash.cuda_impl.CudaTuning`, ``triton``:
:class:`~kvwrite.ops.reshape_and_cache_flash.triton_impl.TritonTuning`) and its alternatives,
each parsed with the field's type; several ``--set`` make every combination. A variant is a new
tuning object per implementation (``dataclasses.replace`` of ``TUNING``), passed to ``run``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence

import torch

from kvwrite import registry
from kvwrite.bench import timing
from kvwrite.bench.workload import Case, InputSet, make_caches, make_input_sets
from kvwrite.dtypes import parse_kv_cache_dtype
from kvwrite.kernels import nvrtc
from kvwrite.ops.reshape_and_cache_flash import OP

__all__ = ["CALLS", "ProbeError", "require_gpu", "time_call", "copy_bandwidth", "point_shape",
           "point_sets", "point_caches", "default_tunings", "parse_value", "parse_set", "Variant",
           "variants", "impl_call", "SOURCE", "kernel", "launch", "pdl_launches",
           "empty_kernel_floor", "empty_triton_floor", "int_list", "str_list", "timed_impls"]

CALLS = 20
COPY_BYTES = 2**30
BLOCK_SIZE = 16


class ProbeError(Exception):
    """A probe cannot run here or was given arguments it cannot use (one line, exit status 2)."""


def require_gpu() -> None:
    if not torch.cuda.is_available():
        raise ProbeError("needs a CUDA GPU (torch.cuda.is_available() is False)")


def int_list(flag: str, text: str) -> list[int]:
    """``"2,64"`` -> [2, 64]; ProbeError naming ``flag`` otherwise."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ProbeError(f"{flag}: expected a comma list of positive integers, got {text!r}")
    return values


def str_list(flag: str, text: str, choices: Sequence[str]) -> list[str]:
    """A comma list whose items are all in ``choices``; ProbeError naming ``flag`` otherwise."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in choices]
    if bad or not values:
        raise ProbeError(f"{flag}: expected a comma list of {', '.join(choices)}, got {text!r}")
    return values


def timed_impls(text: str) -> list[str]:
    """``--impls``: a comma list of registered implementations that a CUDA graph can capture
    (the probes time graphs; the torch reference syncs with the host)."""
    infos = {i.name: i for i in registry.all_impls(OP)}
    names = str_list("--impls", text, list(infos))
    for n in names:
        if not infos[n].graph_safe:
            safe = [i for i, info in infos.items() if info.graph_safe]
            raise ProbeError(f"--impls: {n} cannot be captured in a CUDA graph, which the probes "
                             f"time; expected a comma list of {', '.join(safe)}")
    return names


def time_call(fn: Callable[[], None], replays: int) -> float:
    """Seconds per call of ``fn``: CALLS calls in one CUDA graph, median over ``replays``."""
    return timing.time_device(lambda i: fn(), CALLS, replays, graph=True).median


def copy_bandwidth(nbytes: int = COPY_BYTES) -> float:
    """The GPU's device-to-device copy bandwidth, bytes read + written per second."""
    return timing.copy_bandwidth(torch.device("cuda"), nbytes)


# --------------------------------------------------------------------------------------------
# Points: the workload model's shape, caches and input sets
# --------------------------------------------------------------------------------------------
def point_shape(num_heads: int, head_size: int, layout: str, kv_cache_dtype: str,
                num_blocks: int, dtype: torch.dtype = torch.bfloat16) -> Case:
    """One probe point's workload (:class:`kvwrite.testing.Case`, block size 16; num_tokens is
    set per call). Raises ValueError naming kv_cache_dtype or the layout where they are bad."""
    parse_kv_cache_dtype(kv_cache_dtype)
    return Case.named_layout(layout, num_tokens=0, num_heads=num_heads, head_size=head_size,
                             block_size=BLOCK_SIZE, num_blocks=num_blocks, dtype=dtype,
                             kv_cache_dtype=kv_cache_dtype)


def point_caches(shape: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized caches of ``shape`` on the GPU (what a write leaves is all a probe reads)."""
    return make_caches(shape, torch.device("cuda"))


def point_sets(shape: Case, num_tokens: int, count: int = 1,
               scale: float | None = None) -> list[InputSet]:
    """``count`` input sets (set i = slot set i of the benchmark's recipe) on the GPU."""
    return make_input_sets(shape, num_tokens, count, torch.device("cuda"),
                           scales=None if scale is None else (scale, scale))


# --------------------------------------------------------------------------------------------
# Tuning variants
# --------------------------------------------------------------------------------------------
def default_tunings() -> dict[str, object]:
    """{implementation: its default tuning object} for the implementations that have one."""
    from kvwrite.ops.reshape_and_cache_flash import cuda_impl, triton_impl

    return {"cuda": cuda_impl.TUNING, "triton": triton_impl.TUNING}


_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def parse_value(text: str, like: object, what: str) -> object:
    """``text`` as the type of ``like``: bools true/false/1/0, ints ``int(text, 0)`` (so 0x10
    and 1_024 work), floats; ProbeError naming ``what`` otherwise."""
    t = text.strip()
    try:
        if isinstance(like, bool):
            return _BOOLS[t.lower()]
        if isinstance(like, int):
            return int(t, 0)
        if isinstance(like, float):
            return float(t)
    except (KeyError, ValueError):
        kind = ("true, false, 1 or 0" if isinstance(like, bool)
                else f"a value of type {type(like).__name__}")
        raise ProbeError(f"--set {what}: expected {kind}, got {text!r}") from None
    raise ProbeError(f"--set {what}: fields of type {type(like).__name__} cannot be set")


def parse_set(text: str, tunings: dict[str, object] | None = None
              ) -> tuple[str, str, list[object]]:
    """``"IMPL.FIELD=V1|V2"`` -> (IMPL, FIELD, [values parsed with the field's type])."""
    tunings = default_tunings() if tunings is None else tunings
    target, eq, alts = text.partition("=")
    impl, dot, field = target.strip().partition(".")
    if not eq or not dot or not field or not alts.strip():
        raise ProbeError(f"--set: expected IMPL.FIELD=VALUE or IMPL.FIELD=V1|V2 (IMPL one of "
                         f"{', '.join(tunings)}), got {text!r}")
    if impl not in tunings:
        raise ProbeError(f"--set: expected an implementation with a tuning ({', '.join(tunings)}) "
                         f"before the dot, got {impl!r} in {text!r}")
    names = [f.name for f in dataclasses.fields(tunings[impl])]
    if field not in names:
        raise ProbeError(f"--set: {impl} has no tuning field {field!r}; its fields: "
                         f"{', '.join(names)}")
    like = getattr(tunings[impl], field)
    return impl, field, [parse_value(a, like, f"{impl}.{field}") for a in alts.split("|")]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One combination of ``--set`` values: the tuning object each implementation runs with."""

    settings: tuple[tuple[str, str, object], ...]  # (impl, field, value)
    tunings: dict[str, object]

    @property
    def label(self) -> str:
        return ",".join(f"{i}.{f}={v}" for i, f, v in self.settings)

    def tag(self, impl: str) -> str:
        """``impl`` with the settings that apply to it, e.g. ``triton[tile_bytes=8192]``."""
        own = ",".join(f"{f}={v}" for i, f, v in self.settings if i == impl)
        return f"{impl}[{own}]" if own else impl


def variants(sets: Sequence[str], tunings: dict[str, object] | None = None) -> list[Variant]:
    """Every combination of the ``--set`` options' alternatives (one variant without any)."""
    tunings = default_tunings() if tunings is None else tunings
    axes = [[(impl, field, v) for v in values]
            for impl, field, values in (parse_set(s, tunings) for s in sets)]
    out = []
    for combo in itertools.product(*axes):
        per_impl = dict(tunings)
        for impl, field, value in combo:
            per_impl[impl] = dataclasses.replace(per_impl[impl], **{field: value})
        out.append(Variant(tuple(combo), per_impl))
    return out


def impl_call(impl: str, args: tuple, variant: Variant | None = None) -> Callable[[], None]:
    """A call of implementation ``impl``'s ``run`` on validated ``args`` (the op's run
    arguments), with ``variant``'s tuning where the implementation has one."""
    run = registry.get(OP, impl).run
    tuning = variant.tunings.get(impl) if variant is not None else None
    if tuning is None:
        return functools.partial(run, *args)
    return functools.partial(run, *args, tuning=tuning)


# --------------------------------------------------------------------------------------------
# The probes' minimal kernels (kernels.cu) and the launch floors
# --------------------------------------------------------------------------------------------
SOURCE = nvrtc.KernelSource(__package__, "kernels.cu", "kvwrite_probes")


def kernel(name: str, pdl: bool = False):
    """The loaded kernel ``name`` (a name expression of kernels.cu) for the current GPU; ``pdl``:
    its programmatic-dependent-launch build (``nvrtc.PDL_MACRO``), for :func:`launch` with
    ``pdl=True``."""
    index = torch.cuda.current_device()
    nvrtc.cuda_core().Device(index).set_current()
    arch, _ = nvrtc.device_arch(index)
    return SOURCE.kernel(arch, name, (nvrtc.PDL_MACRO,) if pdl else ())


def launch(kern, grid: tuple[int, int], block: int, *args,
           pdl: bool = False) -> Callable[[], None]:
    """A launch of ``kern`` on PyTorch's current stream, as a callable for :func:`time_call`;
    ``pdl``: with programmatic stream serialization (``kern`` from ``kernel(..., pdl=True)``)."""
    config = nvrtc.launch_config(grid[0], grid[1], block, 1, pdl)
    index = torch.cuda.current_device()
    return lambda: nvrtc.launch(index, config, kern, *args)


def pdl_launches() -> bool:
    """Whether the cuda implementations launch with programmatic dependent launch here (it is on
    and the current GPU takes it), so that a floor should be measured the same way."""
    return nvrtc.pdl_on() and nvrtc.pdl_capable(torch.cuda.current_device())


def empty_kernel_floor(replays: int = 50) -> float:
    """Seconds per call of an empty NVRTC kernel (one thread), launched as the cuda
    implementation launches its kernel: the benchmark's launch floor
    (:func:`kvwrite.bench.timing.empty_kernel_floor`), timed as :func:`time_call` times."""
    return timing.empty_kernel_floor(replays, CALLS)


def empty_triton_floor(replays: int = 50) -> float | None:
    """Seconds per call of an empty Triton kernel (one program, one warp); None without Triton."""
    try:
        import triton
    except ImportError:
        return None

    @triton.jit
    def _empty(x):
        pass

    x = torch.empty(1, device="cuda")
    return time_call(lambda: _empty[(1,)](x, num_warps=1), replays)
