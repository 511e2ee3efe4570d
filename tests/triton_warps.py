"""Every Triton launch at a chosen number of warps, whatever the op's tuning says
(:func:`forced_warps`), and the kernels kvwrite launches (:func:`launched_kernels`).

Every launch in kvwrite is ``kernel[grid](..., num_warps=...)``: Triton's ``__getitem__``
returns a proxy that calls the kernel object's ``run`` (``JITFunction.run`` compiled,
``InterpretedFunction.run`` under ``TRITON_INTERPRET=1``; Triton 3.6 and 3.9 alike), so replacing
``run`` on those classes reaches every launch site, including kernels chosen at run time (the
gathers' shared launcher). A Triton 3.6 miscompile wrote wrong bytes only in one-warp programs
on small tiles (docs/kernel-notes.md), which no op's tuning picks for every kernel."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import pathlib
from collections.abc import Callable, Iterator

__all__ = ["Launch", "forced_warps", "launched_kernels", "kernel_name"]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch: the kernel (``module.function``) and its warps: the compiled kernel's own
    (``metadata.num_warps``) where Triton compiled it, else (the interpreter) the keyword it was
    given."""
    kernel: str
    num_warps: int | None


def kernel_name(kernel) -> str:
    """``module.function`` of a ``triton.jit`` kernel object (compiled or interpreted)."""
    return f"{kernel.fn.__module__}.{kernel.fn.__name__}"


def _launch_classes() -> list[type]:
    """The kernel classes whose ``run`` a ``kernel[grid](...)`` launch calls."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    return [JITFunction, InterpretedFunction]


def _warps(kernel, kwargs: dict) -> int | None:
    metadata = getattr(kernel, "metadata", None)
    if metadata is not None:
        return metadata.num_warps
    return kwargs.get("num_warps")


@contextlib.contextmanager
def _runs_replaced(wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Each launch class's ``run`` replaced by ``wrap(run)``; the originals back on exit (also
    on an exception)."""
    saved = [(cls, cls.__dict__.get("run")) for cls in _launch_classes()]
    try:
        for cls, _ in saved:
            cls.run = wrap(cls.run)
        yield
    finally:
        for cls, own in saved:
            if own is not None:
                cls.run = own
            elif "run" in cls.__dict__:  # inherited before: its base's again
                del cls.run


@contextlib.contextmanager
def forced_warps(n: int) -> Iterator[list[Launch]]:
    """Every Triton kernel launched inside runs with ``num_warps=n`` (the keyword of each launch
    replaced or added; Triton compiles a build per value). Yields the list of the launches made
    inside, in order (:class:`Launch`: on the GPU the compiled kernel's warps, so the list shows
    what Triton built). Every ``triton.jit`` kernel of the process is forced, not only
    kvwrite's."""
    launches: list[Launch] = []

    def wrap(run):
        @functools.wraps(run)
        def forced(self, *args, grid, warmup, **kwargs):
            kwargs["num_warps"] = n
            kernel = run(self, *args, grid=grid, warmup=warmup, **kwargs)
            if not warmup:
                launches.append(Launch(kernel_name(self), _warps(kernel, kwargs)))
            return kernel
        return forced

    with _runs_replaced(wrap):
        yield launches


def _is_jit(decorator: ast.expr) -> bool:
    f = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(f, ast.Attribute) and f.attr == "jit" and isinstance(f.value, ast.Name)
            and f.value.id == "triton")


@functools.cache
def launched_kernels() -> frozenset[str]:
    """``module.function`` of every ``@triton.jit`` function in kvwrite's source that no
    ``@triton.jit`` function refers to: the kernels launched with a grid (the others are device
    functions they call). Read from the source, so a kernel is listed whether or not anything
    imported its module."""
    import kvwrite

    root = pathlib.Path(kvwrite.__file__).parent
    jitted: dict[str, ast.FunctionDef] = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("kvwrite", *path.relative_to(root).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and any(map(_is_jit, node.decorator_list)):
                jitted[f"{module}.{node.name}"] = node
    referred = {n.id if isinstance(n, ast.Name) else n.attr
                for fn in jitted.values() for n in ast.walk(fn)
                if isinstance(n, ast.Name | ast.Attribute)}
    return frozenset(name for name, fn in jitted.items() if fn.name not in referred)
