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

An op is declared in two places, each once: its package's ``__init__`` calls :func:`define_op`
(the OpSpec and its implementations, found by module name), and its public function carries
:func:`custom_op` (the ``torch.library`` custom op torch.compile sees, its fake, and the re-entry
that routes a traced call to it).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping

import torch

__all__ = ["OpSpec", "BenchCommand", "ImplInfo", "ImplStatus", "ImplTable", "register_op", "register", "get", "get_op",
           "ops", "all_impls", "implementations", "select", "installed",
           "define_op", "bench", "StandardImpl", "STANDARD_IMPLS", "NVRTC_KERNEL", "SYNCS_MASKING", "SYNCS_ROW_COUNT",
           "custom_op", "NAMESPACE", "OpArg", "TENSOR", "OPTIONAL_TENSOR", "BOOL", "SAME_INT", "INT", "FLOAT",
           "TEXT", "OPTIONAL_TEXT", "NONE_AS_EMPTY"]

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


def bench(name: str, summary: str, *, module: str | None = None,
          aliases: tuple[str, ...] = ()) -> BenchCommand:
    """The :class:`BenchCommand` ``name`` whose definition is ``BENCH`` in the bench layer's
    ``kvwrite.bench.ops.<module>`` (``module`` defaults to ``name``)."""
    return BenchCommand(name, f"kvwrite.bench.ops.{module or name}:BENCH", summary, aliases)


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


# --- declaring an op ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StandardImpl:
    """One of the implementations every op has: its name, its module under the op's package,
    its priority, the devices a call that names no implementation picks it on, the optional
    packages it needs, and its standard description (``{}``: where an op's detail goes)."""

    name: str
    module: str
    priority: int
    devices: tuple[str, ...] = ("cuda",)
    requires: tuple[str, ...] = ()
    description: str = "{}"

    def describe(self, text: str | None) -> str:
        """The description of this implementation of an op: ``text`` where it opens a sentence
        of its own; where it opens with "(" (after a space), "," or ":" (directly), the standard
        description continued by it; None: the standard description alone."""
        if text is None:
            return self.description.format("")
        if text[:1] == "(":
            return self.description.format(" " + text)
        if text[:1] in (",", ":"):
            return self.description.format(text)
        return text


# The CUDA implementation's standard description.
NVRTC_KERNEL = "CUDA C++ kernel compiled at run time with NVRTC (cuda.core)"
# Every op has these three, found by module name under its package: the plain-PyTorch reference
# (the oracle; it also runs on the CPU), the Triton kernel and the CUDA kernel (NVRTC), preferred
# in that rising order where several can run a call.
STANDARD_IMPLS = (
    StandardImpl("torch", "reference", 0, devices=("cpu", "cuda"),
                 description="plain PyTorch{}; the reference"),
    StandardImpl("triton", "triton_impl", 10, requires=("triton",), description="Triton kernel{}"),
    StandardImpl("cuda", "cuda_impl", 20, description=NVRTC_KERNEL + "{}"),
)
# Implementations an op must describe (the others have a standard description of their own).
_DESCRIBED = ("torch", "triton")
# Why a reference syncs with the host, where several share the reason: the writes mask padding
# and out-of-range slots with a boolean index; the gathers size their rows by the row rule.
SYNCS_MASKING = "boolean masking of padding/out-of-range slots"
SYNCS_ROW_COUNT = "the row count of the rule"


def define_op(name: str, package: str, *, run: str, unsupported: str,
              torch_syncs: str | None = None, bench: BenchCommand | None = None,
              **descriptions: str) -> OpSpec:
    """Register op ``name`` and its :data:`STANDARD_IMPLS`, whose modules live under ``package``
    (the op package's ``__name__``); returns its :class:`OpSpec`.

    ``run`` and ``unsupported``: the arguments of the implementations' ``run`` and
    ``unsupported`` (the text inside the parentheses of ``OpSpec.run_signature`` and
    ``OpSpec.unsupported_signature``). ``descriptions``: one per implementation, by name, as
    :meth:`StandardImpl.describe` takes it: ``torch=`` and ``triton=`` are required (usually a
    detail, ``torch="(index_put_ ...)"`` giving "plain PyTorch (index_put_ ...); the
    reference"), ``cuda=`` is optional (:data:`NVRTC_KERNEL`, continued by a detail if given).
    ``torch_syncs``: why the reference syncs with the host, where it does (it is then not
    graph-safe); None where it does not. ``bench``: the op's benchmark subcommand, if any.
    """
    names = [impl.name for impl in STANDARD_IMPLS]
    unknown = sorted(set(descriptions) - set(names))
    if unknown:
        raise ValueError(f"define_op({name!r}): descriptions: expected implementation names "
                         f"{names}, got {unknown}")
    missing = [n for n in _DESCRIBED if n not in descriptions]
    if missing:
        raise ValueError(f"define_op({name!r}): expected a description of each implementation "
                         f"{names}, got none for {missing}")
    spec = register_op(OpSpec(name=name, run_signature=f"run({run}) -> None",
                              unsupported_signature=f"unsupported({unsupported}) -> str | None",
                              bench=bench))
    for impl in STANDARD_IMPLS:
        register(ImplInfo(op=name, name=impl.name, description=impl.describe(descriptions.get(impl.name)),
                          module=f"{package}.{impl.module}", priority=impl.priority,
                          devices=impl.devices, requires=impl.requires,
                          graph_safe=impl.name != "torch" or torch_syncs is None))
    return spec


# --- the torch.compile boundary -------------------------------------------------------------------

# The torch.library namespace of the ops: the top-level package's name ("kvwrite"; a copy of the
# tree loaded under another name, as the A/B probe does, gets its own namespace).
NAMESPACE = __name__.partition(".")[0]


def _same(value):
    return value


def _text(value) -> str:
    """An enum member as its value, anything else as ``str``."""
    return value.value if isinstance(value, enum.Enum) else str(value)


def _optional_text(value) -> str | None:
    return None if value is None else _text(value)


def _empty_for_none(value) -> str:
    return "" if value is None else _text(value)


def _none_for_empty(value: str) -> str | None:
    return value or None


@dataclasses.dataclass(frozen=True)
class OpArg:
    """How one argument of a public op crosses into its custom op: its type in the custom op's
    schema, its conversion there (``lower``, in the public function while tracing) and back
    (``lift``, in the custom op, before the public function is called with it)."""

    type: object
    lower: Callable = _same
    lift: Callable = _same


_AS_IS = OpArg(object)
TENSOR = OpArg(torch.Tensor)
OPTIONAL_TENSOR = OpArg(torch.Tensor | None)
BOOL = OpArg(bool)
# An integer as given (the schema's SymInt); INT converts it first (int(x)).
SAME_INT = OpArg(int)
INT = OpArg(int, int)
FLOAT = OpArg(float, float)
# A string or an enum member (crossing as its value).
TEXT = OpArg(str, _text)
OPTIONAL_TEXT = OpArg(str | None, _optional_text)
# An optional string crossing as "" for None (as every op's ``implementation`` does).
NONE_AS_EMPTY = OpArg(str, _empty_for_none, _none_for_empty)

# The crossing of an argument by its annotation in the public function.
_BY_ANNOTATION = {"torch.Tensor": TENSOR, "torch.Tensor | None": OPTIONAL_TENSOR, "bool": BOOL,
                  "int": SAME_INT, "float": FLOAT, "str": TEXT, "str | None": OPTIONAL_TEXT}
# Arguments that cross the same way in every op, whatever their annotation.
_BY_NAME = {"implementation": NONE_AS_EMPTY}


def custom_op(name: str, mutates: tuple[str, ...], *, args: Mapping[str, OpArg] | None = None,
              lower: Callable[..., tuple] | None = None, entry: Callable | None = None):
    """Decorate a public op function: register the ``torch.library`` custom op
    ``<NAMESPACE>::<name>`` that mutates the arguments ``mutates``, its fake (the op returns
    nothing, so the fake returns None), and route the function's calls while torch.compile
    traces to that op, which then runs the function eagerly: the compiled graph holds one opaque,
    mutating call. Outside tracing the decorated function is the function itself (same name,
    signature and docstring).

    By default the custom op's arguments are the function's, in order (keyword-only ones become
    positional), each crossing by its annotation: tensors and optional tensors, bool, int and
    float as such, ``str`` (an enum member crosses as its value), ``str | None``; and
    ``implementation`` as a string, "" for None. ``args`` overrides that per argument name.

    Where the crossing is not one argument at a time, ``entry`` is the custom op's body (its
    annotated signature is the schema; it calls the public function) and ``lower`` maps the
    function's arguments (all of them, in order, defaults filled in) to ``entry``'s.
    """
    if (lower is None) != (entry is None):
        raise ValueError(f"custom_op({name!r}): expected both lower and entry, or neither")

    def decorate(fn):
        if entry is None:
            params = _crossings(name, fn, dict(args or {}))
            body, lowering = _derived_entry(fn, params), _lowering(fn, params)
        else:
            if args:
                raise ValueError(f"custom_op({name!r}): args: expected none with an entry, "
                                 f"got {sorted(args)}")
            # The call bound as the function binds it (defaults filled in), then lowered whole.
            bind = _lowering(fn, [(p, _AS_IS) for p in inspect.signature(fn).parameters.values()])
            body = entry

            def lowering(*call_args, **call_kwargs):
                return lower(*bind(*call_args, **call_kwargs))
        params_of_body = inspect.signature(body).parameters
        unknown = [m for m in mutates if m not in params_of_body]
        if unknown:
            raise ValueError(f"custom_op({name!r}): mutates: expected arguments of the op "
                             f"{list(params_of_body)}, got {unknown}")
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", body, mutates_args=tuple(mutates))

        @op.register_fake
        def _fake(*_args, **_kwargs) -> None:
            return None

        packet = getattr(getattr(torch.ops, NAMESPACE), name)

        @functools.wraps(fn)
        def public(*call_args, **call_kwargs):
            if torch.compiler.is_compiling():
                packet(*lowering(*call_args, **call_kwargs))
                return None
            return fn(*call_args, **call_kwargs)

        public.custom_op = op
        return public

    return decorate


def _crossings(name: str, fn, args: dict[str, OpArg]) -> list[tuple[inspect.Parameter, OpArg]]:
    """Each parameter of ``fn`` with its crossing (``args``, else by name, else by annotation)."""
    params = list(inspect.signature(fn).parameters.values())
    unknown = sorted(set(args) - {p.name for p in params})
    if unknown:
        raise ValueError(f"custom_op({name!r}): args: expected arguments of {fn.__name__}, "
                         f"got {unknown}")
    out = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ValueError(f"custom_op({name!r}): {p.name}: expected a named argument, got "
                             f"{p.kind.description}")
        annotation = (p.annotation if isinstance(p.annotation, str)
                      else inspect.formatannotation(p.annotation))
        crossing = args.get(p.name) or _BY_NAME.get(p.name) or _BY_ANNOTATION.get(annotation)
        if crossing is None:
            raise ValueError(f"custom_op({name!r}): {p.name}: expected an annotation among "
                             f"{sorted(_BY_ANNOTATION)} or an entry in args, got "
                             f"{'none' if p.annotation is p.empty else repr(p.annotation)}")
        out.append((p, crossing))
    return out


def _derived_entry(fn, params):
    """The custom op's body: the public function's arguments, lifted back, passed as it takes
    them (keyword-only ones by name)."""

    def body(*values):
        positional, keywords = [], {}
        for (p, crossing), value in zip(params, values, strict=True):
            value = crossing.lift(value)
            if p.kind == p.KEYWORD_ONLY:
                keywords[p.name] = value
            else:
                positional.append(value)
        fn(*positional, **keywords)

    body.__signature__ = inspect.Signature(
        [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=c.type)
         for p, c in params], return_annotation=None)
    body.__name__ = body.__qualname__ = fn.__name__
    body.__module__ = fn.__module__
    body.__doc__ = f"{fn.__name__} as torch.compile sees it: one opaque, mutating call."
    return body


def _lowering(fn, params):
    """A public call's arguments, bound as Python binds them, defaults filled in, lowered.
    Written as plain loops so that torch.compile traces it without a graph break."""
    positional = [p.name for p, _ in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    names = {p.name for p, _ in params}

    def lowering(*call_args, **call_kwargs):
        if len(call_args) > len(positional):
            raise TypeError(f"{fn.__name__}() takes at most {len(positional)} positional "
                            f"arguments but {len(call_args)} were given")
        for key in call_kwargs:
            if key not in names:
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {key!r}")
        values = []
        for i, (p, crossing) in enumerate(params):
            if i < len(call_args):
                if p.name in call_kwargs:
                    raise TypeError(f"{fn.__name__}() got multiple values for argument "
                                    f"{p.name!r}")
                value = call_args[i]
            elif p.name in call_kwargs:
                value = call_kwargs[p.name]
            elif p.default is not p.empty:
                value = p.default
            else:
                raise TypeError(f"{fn.__name__}() missing required argument: {p.name!r}")
            values.append(crossing.lower(value))
        return values

    return lowering
