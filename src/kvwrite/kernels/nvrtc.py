"""Build, cache and launch CUDA kernels compiled at run time with NVRTC (through ``cuda.core``).

Every op's CUDA implementation keeps its kernel as a ``.cu`` file beside its launcher and uses
this module for everything else:

- :class:`KernelSource`: a ``.cu`` file found as package data (works from a wheel too), compiled
  with kvwrite's shared headers (``kernels/include/kvw/*.cuh``) on NVRTC's include path, to one
  cubin per (architecture, kernel name expressions, macros); :meth:`KernelSource.kernel` caches
  the loaded kernel per process. Needs no GPU to compile (cubin, not PTX: tests compile on CPU).
- :func:`setup_reason`: None where cuda.core, NVRTC and a GPU are usable, else what is missing
  and what to install.
- :func:`device_arch`, :func:`current_stream` (PyTorch's current stream as a cuda.core stream),
  :func:`capture_relaxed` (load a module while PyTorch captures a CUDA graph),
  :func:`launch_config` and :func:`launch` (which makes the device's context current on a thread
  that never used it).
- Programmatic dependent launch (:func:`use_pdl`, :func:`pdl_capable`, ``launch_config(...,
  pdl=True)``): a kernel built with ``KVWRITE_PDL`` (kvw/common.cuh's ``KVW_PDL_ENTRY``) and
  launched with programmatic stream serialization is scheduled while the kernel before it in the
  stream still runs, and waits for it before reading anything; the kernel after it may be
  scheduled as soon as all of its CTAs have started. On by default on devices that allow it
  (compute capability 9.0 and later); ``KVWRITE_PDL=0`` in the environment or ``use_pdl(False)``
  turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import os
from collections.abc import Sequence

import torch

__all__ = ["INSTALL_HINT", "KernelSource", "available", "cuda_core", "setup_reason", "device_arch",
           "include_dir", "current_stream", "capture_relaxed", "launch_config", "launch",
           "pdl_capable", "pdl_on", "use_pdl", "pdl_twin", "takes_pdl", "PDL_MACRO",
           "PDL_NO_TRIGGER_MACRO"]

# The macro of a kernel build that starts with KVW_PDL_ENTRY (launch it with pdl=True), and the
# one that leaves out its trigger of the next kernel (PDL_NO_TRIGGER_MACRO: wait only).
PDL_MACRO = "KVWRITE_PDL"
PDL_NO_TRIGGER_MACRO = "KVWRITE_PDL_NO_TRIGGER"
_PDL = [os.environ.get("KVWRITE_PDL", "1").strip() != "0"]


def use_pdl(enabled: bool) -> None:
    """Launch the cuda implementations' calls with programmatic dependent launch (where their
    tuning and the device allow it) or not, from the next call on."""
    _PDL[0] = bool(enabled)


def pdl_on() -> bool:
    """Whether programmatic dependent launch is on (:func:`use_pdl`, ``KVWRITE_PDL``)."""
    return _PDL[0]

INSTALL_HINT = "pip install cuda-core cuda-bindings nvidia-cuda-nvrtc"


@functools.cache
def cuda_core():
    """The ``cuda.core`` module; ImportError naming what to install where it is missing."""
    try:
        import cuda.core as cc
    except ImportError as e:
        raise ImportError(f"the cuda implementations need cuda.core ({e}); {INSTALL_HINT}") from e
    return cc


def include_dir() -> str:
    """The directory holding ``kvw/*.cuh``, the kernel headers every op's source includes."""
    return str(importlib.resources.files(__package__).joinpath("include"))


class _Log:
    def __init__(self):
        self.parts: list[str] = []

    def write(self, text) -> None:
        self.parts.append(text.decode(errors="replace") if isinstance(text, bytes) else str(text))


class KernelSource:
    """One op's kernel source file, compiled with NVRTC on demand.

    ``package`` and ``filename`` locate the ``.cu`` file as package data; ``program_name`` is the
    name NVRTC reports in its diagnostics.
    """

    def __init__(self, package: str, filename: str, program_name: str):
        self.package = package
        self.filename = filename
        self.program_name = program_name
        self._kernels: dict[tuple, object] = {}

    @functools.cached_property
    def text(self) -> str:
        return importlib.resources.files(self.package).joinpath(self.filename).read_text(
            encoding="utf-8")

    def compile(self, arch: str, names: str | Sequence[str], *, source: str | None = None,
                macros: Sequence[str | tuple[str, str]] = (), ptxas_verbose: bool = False):
        """Compile kernel variants (name expressions) to one cubin for ``arch`` (e.g. "sm_90").

        ``source`` replaces the file's text (tests and probes append kernels to it). Returns
        ``(object_code, log)``: a cuda.core ``ObjectCode`` (``.code`` is the cubin,
        ``.get_kernel(name)`` a kernel) and NVRTC's log (with ``ptxas_verbose``, ptxas's register
        and spill report). A compile error raises RuntimeError carrying NVRTC's log.
        """
        names = (names,) if isinstance(names, str) else tuple(names)
        cc = cuda_core()
        options = cc.ProgramOptions(name=self.program_name, arch=arch, std="c++17",
                                    define_macro=list(macros) or None,
                                    include_path=[include_dir()],
                                    ptxas_options="-v" if ptxas_verbose else None)
        program = cc.Program(self.text if source is None else source, "c++", options)
        log = _Log()
        try:
            obj = program.compile("cubin", name_expressions=names, logs=log)
        except Exception as e:  # cuda.core's NVRTCError carries the compilation log in its text
            what = names[0] if len(names) == 1 else f"{len(names)} kernel variants"
            text = f"{e}\n{''.join(log.parts)}".replace("\x00", "").strip()
            raise RuntimeError(f"cuda: NVRTC could not compile {what} for {arch}:\n{text}") from e
        finally:
            program.close()
        return obj, "".join(log.parts).replace("\x00", "")

    def kernel(self, arch: str, name: str, macros: tuple = ()):
        """The loaded kernel ``name`` built with ``macros``, compiled once per process."""
        key = (arch, name, macros)
        k = self._kernels.get(key)
        if k is None:
            obj, _ = self.compile(arch, name, macros=macros)
            k = self._kernels[key] = obj.get_kernel(name)
        return k


@functools.cache
def setup_reason() -> str | None:
    """None when cuda.core, NVRTC and a CUDA GPU are usable here, else why not (what to install)."""
    try:
        cuda_core()
    except ImportError as e:
        return str(e)
    try:
        from cuda.bindings import nvrtc

        err, _, _ = nvrtc.nvrtcVersion()
        if int(err) != 0:
            raise RuntimeError(f"nvrtcVersion returned {err}")
    except Exception as e:  # the library itself is missing or broken
        return f"the cuda implementations cannot load NVRTC ({e}); {INSTALL_HINT}"
    if not torch.cuda.is_available():
        return ("the cuda implementations need a CUDA GPU visible to PyTorch "
                "(none found: no GPU, no NVIDIA driver, or a CPU-only PyTorch build)")
    return None


@functools.cache
def available(device: torch.device) -> str | None:
    """Every CUDA implementation's ``available``: None on a CUDA device with cuda.core and NVRTC
    loadable, else why not (what to install)."""
    if device.type != "cuda":
        return f"the cuda implementation runs on CUDA devices only, got {device.type!r}"
    return setup_reason()


@contextlib.contextmanager
def capture_relaxed():
    """Let this thread load a module while PyTorch captures a CUDA graph (first call of a variant
    inside torch.cuda.graph): global capture mode forbids it, relaxed mode allows it."""
    if not torch.cuda.is_current_stream_capturing():
        yield
        return
    from cuda.bindings import driver

    modes = driver.CUstreamCaptureMode
    _, previous = driver.cuThreadExchangeStreamCaptureMode(modes.CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        yield
    finally:
        driver.cuThreadExchangeStreamCaptureMode(previous)


@functools.cache
def device_arch(index: int) -> tuple[str, int]:
    """(arch such as "sm_90", SM count) of CUDA device ``index``."""
    dev = cuda_core().Device(index)
    major, minor = dev.compute_capability
    return f"sm_{major}{minor}", dev.properties.multiprocessor_count


@functools.cache
def pdl_capable(index: int) -> bool:
    """Whether device ``index`` takes programmatic dependent launches from here: compute capability
    9.0 or later (griddepcontrol) and a cuda.core whose LaunchConfig can ask for them."""
    major = cuda_core().Device(index).compute_capability[0]
    return major >= 9 and hasattr(cuda_core().LaunchConfig, "programmatic_stream_serialization")


def pdl_twin(source: KernelSource, arch: str, name: str, macros: tuple, index: int,
             trigger: bool = True):
    """The PDL build of ``source.kernel(arch, name, macros)`` (with :data:`PDL_MACRO`, and
    :data:`PDL_NO_TRIGGER_MACRO` unless ``trigger``), or None where device ``index`` cannot take
    programmatic dependent launches (:func:`pdl_capable`). Call it where the plain build is
    loaded (inside :func:`capture_relaxed`, the device current)."""
    if not pdl_capable(index):
        return None
    extra = (PDL_MACRO,) if trigger else (PDL_MACRO, PDL_NO_TRIGGER_MACRO)
    return source.kernel(arch, name, tuple(macros) + extra)


def takes_pdl(pdl_kernel, ctas: int, max_ctas: int) -> bool:
    """Whether a launch of ``ctas`` CTAs takes its PDL twin ``pdl_kernel`` (:func:`pdl_twin`):
    there is one, programmatic dependent launch is on (:func:`use_pdl`), and ``ctas`` is at most
    ``max_ctas`` (the op's tuning)."""
    return pdl_kernel is not None and _PDL[0] and ctas <= max_ctas


@functools.cache
def launch_config(grid_x: int, grid_y: int, block_x: int, block_y: int, pdl: bool = False):
    """A launch of [grid_x, grid_y] CTAs of [block_x, block_y] threads; ``pdl``: with programmatic
    stream serialization, for a kernel built with :data:`PDL_MACRO` on a :func:`pdl_capable`
    device."""
    extra = {"programmatic_stream_serialization": True} if pdl else {}
    return cuda_core().LaunchConfig(grid=(grid_x, grid_y, 1), block=(block_x, block_y, 1), **extra)


_STREAMS: dict[int, object] = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int):
    """PyTorch's current stream on ``device_index`` as a cuda.core stream (cached per handle)."""
    # torch._C._cuda_getCurrentRawStream skips building a torch.cuda.Stream per call.
    handle = (_raw_stream(device_index) if _raw_stream is not None
              else torch.cuda.current_stream(device_index).cuda_stream)
    stream = _STREAMS.get(handle)
    if stream is None:
        with capture_relaxed():
            stream = _STREAMS[handle] = cuda_core().Stream.from_handle(handle)
    return stream


def launch(device_index: int, config, kernel, *args) -> None:
    """Launch ``kernel`` on PyTorch's current stream of ``device_index``."""
    stream = current_stream(device_index)
    cc = cuda_core()
    try:
        cc.launch(stream, config, kernel, *args)
    except Exception:
        # A thread on which nothing made the device's context current yet: do it and retry
        # once (a launch error of any other kind raises again).
        cc.Device(device_index).set_current()
        cc.launch(stream, config, kernel, *args)
