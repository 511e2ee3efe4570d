"""Build, cache and launch CUDA kernels compiled at run time with NVRTC (through ``cuda.core``).

Every op's CUDA implementation keeps its kernel as a ``.cu`` file beside its launcher and uses
this module for everything else:

- :class:`KernelSource`: a ``.cu`` file found as package data (works from a wheel too), compiled
  with kvwrite's shared headers (``kernels/include/kvw/*.cuh``) on NVRTC's include path, to one
  cubin per (architecture, kernel name expressions, macros); :meth:`KernelSource.kernel` caches
  the loaded kernel per process. Needs no GPU to compile (cubin, not PTX: tests compile on CPU).
- The kernel cache on disk (:func:`kernel_cache_dir`): :meth:`KernelSource.cubin` keeps each
  build's cubin between processes, keyed by everything that goes into it (the source, the shared
  headers, the architecture, the name expression, the macros, NVRTC's and cuda.core's versions),
  so a new process loads it instead of compiling it again. ``KVWRITE_KERNEL_CACHE=0`` turns it
  off; ``KVWRITE_CACHE_DIR`` moves it (default ``$XDG_CACHE_HOME/kvwrite`` or
  ``~/.cache/kvwrite``). A cache that cannot be read or written is compiled around, never an
  error.
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
import hashlib
import importlib.resources
import os
import tempfile
from collections.abc import Sequence

import torch

__all__ = ["INSTALL_HINT", "KernelSource", "available", "cuda_core", "setup_reason", "device_arch",
           "include_dir", "current_stream", "capture_relaxed", "launch_config", "launch",
           "pdl_capable", "pdl_on", "use_pdl", "pdl_twin", "takes_pdl", "PDL_MACRO",
           "PDL_NO_TRIGGER_MACRO", "kernel_cache_dir", "FIXED_ARGS_MACRO", "fixed_args_macros",
           "env_flag", "specialize_default"]

# The macro of a kernel build that starts with KVW_PDL_ENTRY (launch it with pdl=True), and the
# one that leaves out its trigger of the next kernel (PDL_NO_TRIGGER_MACRO: wait only).
PDL_MACRO = "KVWRITE_PDL"
PDL_NO_TRIGGER_MACRO = "KVWRITE_PDL_NO_TRIGGER"
_PDL = [os.environ.get("KVWRITE_PDL", "1").strip() != "0"]


# The macro of a build specialized for one call signature: the kernel's trailing scalar arguments
# (each op's kernel.cu says which) as compile-time constants, "v0,v1,...".
FIXED_ARGS_MACRO = "KVWRITE_FIXED_ARGS"


def fixed_args_macros(fixed: Sequence[int] | None) -> tuple:
    """The macros of a build with ``fixed`` compiled in (none for a generic build: None)."""
    if fixed is None:
        return ()
    return ((FIXED_ARGS_MACRO, ",".join(str(int(v)) for v in fixed)),)


def env_flag(name: str, default: str) -> bool:
    """An on/off setting from the environment variable ``name`` (``default`` when unset): off
    when it is 0 or empty, on otherwise."""
    return os.environ.get(name, default).strip() not in ("", "0")


def specialize_default() -> bool:
    """Whether the cuda implementations build one kernel per call signature with its fixed
    arguments compiled in (their ``CudaTuning.specialize``): yes unless
    ``KVWRITE_CUDA_SPECIALIZE`` is 0 or empty."""
    return env_flag("KVWRITE_CUDA_SPECIALIZE", "1")


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

    def compile_fixed(self, arch: str, names: str | Sequence[str], *, source: str | None = None,
                      fixed: Sequence[int] | None = None, macros: Sequence = (),
                      ptxas_verbose: bool = False):
        """:meth:`compile` of the build with ``fixed`` (the kernels' trailing scalar arguments,
        :data:`FIXED_ARGS_MACRO`) compiled in after ``macros``; the generic build where
        ``fixed`` is None. Each op's ``compile_kernel`` (tests and probes)."""
        return self.compile(arch, names, source=source,
                            macros=tuple(macros) + fixed_args_macros(fixed),
                            ptxas_verbose=ptxas_verbose)

    def kernel(self, arch: str, name: str, macros: tuple = ()):
        """The loaded kernel ``name`` built with ``macros``: once per process, from
        :meth:`cubin` (the disk cache, or NVRTC)."""
        key = (arch, name, macros)
        k = self._kernels.get(key)
        if k is None:
            cubin, mangled = self.cubin(arch, name, macros)
            obj = cuda_core().ObjectCode.from_cubin(
                cubin, symbol_mapping=None if mangled is None else {name: mangled})
            k = self._kernels[key] = obj.get_kernel(name)
        return k

    def cubin(self, arch: str, name: str, macros: tuple = ()) -> tuple[bytes, bytes | None]:
        """(cubin, mangled symbol or None) of kernel ``name`` built with ``macros`` for ``arch``:
        read from the disk cache (:func:`kernel_cache_dir`) when it holds this exact build, else
        compiled and stored there."""
        root = kernel_cache_dir()
        path = None if root is None else os.path.join(root, self._build_key(arch, name, macros))
        if path is not None:
            found = _read_entry(path)
            if found is not None:
                return found
        obj, _ = self.compile(arch, name, macros=macros)
        cubin = bytes(obj.code)
        mangled = obj.symbol_mapping.get(name) if obj.symbol_mapping else None
        if path is not None:
            _write_entry(path, cubin, mangled)
        return cubin, mangled

    def _build_key(self, arch: str, name: str, macros: tuple) -> str:
        """A file name that changes with anything that changes the build."""
        h = hashlib.sha256()
        for part in (str(_CACHE_FORMAT), self.program_name, self.text, _headers_digest(), arch,
                     name, repr(tuple(macros)), _compiler_versions()):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest() + ".cubin"


# The disk cache of compiled kernels. Entry: magic, the mangled symbol's length (2 bytes) and
# text, the cubin's SHA-256, the cubin; an entry that does not check out is compiled again.
_CACHE_FORMAT = 1
_MAGIC = b"kvwrite-cubin-1\n"


def kernel_cache_dir() -> str | None:
    """The directory of the kernel cache on disk, or None where ``KVWRITE_KERNEL_CACHE=0``:
    ``$KVWRITE_CACHE_DIR/nvrtc``, else ``$XDG_CACHE_HOME/kvwrite/nvrtc``, else
    ``~/.cache/kvwrite/nvrtc``."""
    if os.environ.get("KVWRITE_KERNEL_CACHE", "1").strip() == "0":
        return None
    root = os.environ.get("KVWRITE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "kvwrite")
    return os.path.join(root, "nvrtc")


@functools.cache
def _headers_digest() -> str:
    """SHA-256 over the shared headers' paths and texts (every build includes them)."""
    h = hashlib.sha256()
    base = include_dir()
    for dirpath, _, files in sorted(os.walk(base)):
        for f in sorted(files):
            path = os.path.join(dirpath, f)
            h.update(os.path.relpath(path, base).encode() + b"\0")
            with open(path, "rb") as fh:
                h.update(fh.read() + b"\0")
    return h.hexdigest()


@functools.cache
def _compiler_versions() -> str:
    """NVRTC's and cuda.core's versions (a new compiler may build other code)."""
    try:
        from cuda.bindings import nvrtc as _nvrtc

        _, major, minor = _nvrtc.nvrtcVersion()
        nvrtc_version = f"{major}.{minor}"
    except Exception:  # an older binding: the key still changes with cuda.core's version
        nvrtc_version = "?"
    return f"nvrtc {nvrtc_version}, cuda.core {getattr(cuda_core(), '__version__', '?')}"


def _read_entry(path: str) -> tuple[bytes, bytes | None] | None:
    """The entry at ``path`` if it is there and intact, else None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 2:
        return None
    at = len(_MAGIC)
    n = int.from_bytes(data[at:at + 2], "little")
    mangled, at = data[at + 2:at + 2 + n], at + 2 + n
    digest, cubin = data[at:at + 32], data[at + 32:]
    if len(digest) != 32 or not cubin or hashlib.sha256(cubin).digest() != digest:
        return None
    return cubin, (mangled or None)


def _write_entry(path: str, cubin: bytes, mangled: bytes | None) -> None:
    """Store an entry atomically (a temporary file renamed into place); errors are ignored."""
    mangled = mangled or b""
    data = (_MAGIC + len(mangled).to_bytes(2, "little") + mangled
            + hashlib.sha256(cubin).digest() + cubin)
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)


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


def load_kernels(source: KernelSource, name: str, macros: tuple, index: int,
                 trigger: bool = True):
    """``(kernel, pdl_kernel)``: variant ``name`` of ``source`` built with ``macros`` for CUDA
    device ``index`` (compiled, or read from the kernel cache) and its :func:`pdl_twin`, loaded
    in PyTorch's primary context on this thread, also while a CUDA graph is being captured."""
    with capture_relaxed():
        cuda_core().Device(index).set_current()  # PyTorch's primary context, this thread
        arch, _ = device_arch(index)
        kernel = source.kernel(arch, name, macros)
        return kernel, pdl_twin(source, arch, name, macros, index, trigger=trigger)


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
