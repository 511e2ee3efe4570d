"""The registry of ops and their implementations, keyed by (op, implementation).

Each op registers an :class:`OpSpec` that states the signature every implementation of it shares:
its implementation modules expose

    run(*run_args) -> None            # the op's arguments, validated by the public op
    available(device) -> str | None   # None if it can run on that device here, else why not
    unsupported(*case_args) -> str | None   # None if it can run this validated case, else why
    prepare(*run_args) -> str | None  # optional: once per argument set, outside timed calls

``run`` is called only with arguments the public op has validated; it must do no host sync and
no allocation on the hot path unless its entry says it is not graph-safe. Modules are imported
lazily, so importing kvwrite never pulls in triton or cuda.core.

The tests and the benchmark iterate the registry, so a new implementation is tested and
benchmarked as soon as it registers (CONTRIBUTING.md).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable

import torch

__all__ = ["OpSpec", "BenchCommand", "ImplInfo", "ImplStatus", "ImplTable", "register_op", "register", "get", "get_op",
           "ops", "all_impls", "implementations", "select", "installed"]

RunFn = Callable[..., None]


@dataclasses.dataclass(frozen=True)
class BenchCommand:
    """An op's ``kvwrite-bench`` subcommand: its name, aliases, its definition
    ("module:attribute", in the bench layer, imported only when the subcommand runs) and one line
    for ``--help``."""

    name: str
    target: str
    summary: str
    aliases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """An op: its name, the public function, and the signatures its implementations share."""

    name: str
    # The shared signatures, as text (shown by docs and error messages).
    run_signature: str
    unsupported_signature: str
    # The op's benchmark subcommand, where it has one (the CLI lists the registry's).
    bench: BenchCommand | None = None


@dataclasses.dataclass(frozen=True)
class ImplInfo:
    op: str
    name: str
    description: str
    # Module that defines `run`, `available` and `unsupported` (see the module doc).
    module: str
    # Higher wins when the caller names no implementation.
    priority: int
    # Device types this implementation is meant for; a call that names no implementation only
    # picks among these (Triton's CPU interpreter is for tests, not for default use).
    devices: tuple[str, ...] = ("cuda",)
    # Safe to capture in a CUDA graph (no host sync, no allocation per call).
    graph_safe: bool = True
    # Optional packages the module needs (e.g. "triton"): where one is missing, `available`
    # names it with its pip command instead of the import error it would cause.
    requires: tuple[str, ...] = ()

    def _mod(self):
        return importlib.import_module(self.module)

    @property
    def run(self) -> RunFn:
        return self._mod().run

    def available(self, device: torch.device | str) -> str | None:
        """None if this implementation can run on `device` here, else the reason it cannot."""
        for package in self.requires:
            if not installed(package):
                return f"{package} is not installed (pip install {package})"
        try:
            mod = self._mod()
        except ImportError as e:  # a missing optional dependency
            return f"{self.name}: cannot import {self.module}: {e}"
        return mod.available(torch.device(device))

    def prepare(self, *run_args) -> str | None:
        """Work done once per set of arguments before they are timed or captured (a peer's
        argument conversion), for modules that define ``prepare(*run_args)``; None when ready,
        else why these arguments cannot run."""
        fn = getattr(self._mod(), "prepare", None)
        return None if fn is None else fn(*run_args)

    def unsupported(self, *case_args) -> str | None:
        """None if this implementation can run this (validated) case, else the reason. The first
        argument is a tensor on the call's device (the op's ``unsupported_signature``)."""
        reason = self.available(case_args[0].device)
        if reason is not None:
            return reason
        return self._mod().unsupported(*case_args)


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None
        return False


@dataclasses.dataclass(frozen=True)
class ImplStatus:
    op: str
    name: str
    available: bool
    reason: str | None
    description: str


class ImplTable(list):
    """A list of :class:`ImplStatus` (what :func:`implementations` returns) that prints as a
    table: one row per op and implementation, "yes" where it can run on ``device``, else why not."""

    def __init__(self, statuses=(), device: str = ""):
        super().__init__(statuses)
        self.device = device

    def __str__(self) -> str:
        header = ("op", "implementation", f"runs on {self.device}?" if self.device else "runs?")
        rows, last_op = [], None
        for s in self:
            rows.append(("" if s.op == last_op else s.op, s.name,
                         "yes" if s.available else f"no: {s.reason}"))
            last_op = s.op
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(2)]

        def line(r):
            return f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}".rstrip()

        return "\n".join([line(header), line(tuple("-" * w for w in (*widths, len(header[2])))),
                          *map(line, rows)])

    __repr__ = __str__


_OPS: dict[str, OpSpec] = {}
_REGISTRY: dict[tuple[str, str], ImplInfo] = {}


def register_op(spec: OpSpec) -> OpSpec:
    if spec.name in _OPS:
        raise ValueError(f"op {spec.name!r} is already registered")
    _OPS[spec.name] = spec
    return spec


def register(info: ImplInfo) -> ImplInfo:
    if info.op not in _OPS:
        raise ValueError(f"implementation {info.name!r}: op {info.op!r} is not registered")
    if (info.op, info.name) in _REGISTRY:
        raise ValueError(f"implementation {info.name!r} of {info.op!r} is already registered")
    _REGISTRY[(info.op, info.name)] = info
    return info


def get_op(op: str) -> OpSpec:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"op: expected one of {sorted(_OPS)}, got {op!r}") from None


def ops() -> list[str]:
    """Every registered op, in registration order."""
    return list(_OPS)


def get(op: str, name: str) -> ImplInfo:
    get_op(op)
    try:
        return _REGISTRY[(op, name)]
    except KeyError:
        names = sorted(n for o, n in _REGISTRY if o == op)
        raise ValueError(f"implementation: expected one of {names}, got {name!r}") from None


def all_impls(op: str) -> list[ImplInfo]:
    """Every registered implementation of ``op``, preferred first."""
    get_op(op)
    return sorted((i for i in _REGISTRY.values() if i.op == op), key=lambda i: -i.priority)


def implementations(device: torch.device | str | None = None,
                    op: str | None = None) -> ImplTable:
    """Each registered implementation (of ``op``, or of every op, grouped by op), whether it can
    run on ``device`` here, and why not: a list of :class:`ImplStatus` that prints as a table.

    ``device`` defaults to "cuda" when PyTorch sees a GPU, else "cpu".
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = ImplTable(device=str(device))
    for name in ([op] if op is not None else ops()):
        for info in all_impls(name):
            reason = info.available(device)
            out.append(ImplStatus(info.op, info.name, reason is None, reason, info.description))
    return out


def select(op: str, case_args: tuple, implementation: str | None = None) -> ImplInfo:
    """The named implementation of ``op``, or the preferred one that can run this case (whose
    ``unsupported`` arguments are ``case_args``); raises ValueError saying why where none can."""
    if implementation is not None:
        info = get(op, implementation)
        reason = info.unsupported(*case_args)
        if reason is not None:
            raise ValueError(f"implementation={implementation!r} cannot run this call: {reason}")
        return info
    reasons = []
    device_type = case_args[0].device.type
    for info in all_impls(op):
        if device_type not in info.devices:
            continue
        reason = info.unsupported(*case_args)
        if reason is None:
            return info
        reasons.append(f"{info.name}: {reason}")
    raise ValueError("no implementation can run this call: " + "; ".join(reasons))
