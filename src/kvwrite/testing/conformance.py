"""The conformance suite's contract with each op: one :class:`Provider` per registered op, declared
in ``kvwrite.testing.providers.<op name>`` as ``PROVIDER``. It says how to build the op's
arguments for a case, which of them the op writes, how to compare what it wrote, and lists the
op's cases for each test kind of ``tests/test_conformance.py`` (bytes against the reference,
deliberately wrong writers, bad input, CUDA-graph replay, ``torch.compile``, Triton at forced
warps) and its NVRTC compile of every variant. An op registered without a provider module fails
the suite, so a new op cannot be left out of it."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import registry
from .compare import assert_caches_equal, copy_allocations

__all__ = ["Provider", "Example", "BadInput", "WrongWriter", "provider", "providers",
           "missing_providers", "tensors", "written", "with_copies", "snapshot", "unchanged",
           "run_reference", "bad_inputs", "replaced", "compile_every_variant", "small_tiles"]


@dataclasses.dataclass(frozen=True)
class Example:
    """One case of a test kind: ``id`` names it in the test id, ``case`` is what ``build`` takes;
    ``gpu``: run it on CUDA devices only (its test items carry the ``gpu`` marker)."""
    id: str
    case: Any
    gpu: bool = False


@dataclasses.dataclass(frozen=True)
class WrongWriter:
    """A deliberately wrong implementation: ``write(*args)`` takes the op's public arguments (as
    ``build`` returns them) and writes the mutated ones wrongly; ``check`` must then fail."""
    id: str
    write: Callable[..., None]
    case: Any


@dataclasses.dataclass(frozen=True)
class BadInput:
    """``make()`` -> (args, kwargs) of one call of the public function that must raise ``exc``
    with ``text`` in its message, having changed no byte of any tensor it was given."""
    id: str
    make: Callable[[], tuple[tuple, dict]]
    exc: type
    text: str
    # The function called (default: the provider's ``public``, else its ``call``).
    call: Callable[..., Any] | None = None


def bad_inputs(table, valid_args: Callable[[], dict]) -> tuple[BadInput, ...]:
    """The :class:`BadInput` of each ``(id, change, exc, text)`` of ``table``: the valid call's
    keyword arguments (``valid_args()``, new tensors each time) with those of ``change(args)``
    in their place."""
    def make(change):
        def call():
            args = valid_args()
            return (), {**args, **change(args)}
        return call
    return tuple(BadInput(name, make(change), exc, text) for name, change, exc, text in table)


def replaced(valid_args: Callable[[], dict], changes: dict[str, Callable[[dict], Any]]
             ) -> Callable[[], tuple[tuple, dict]]:
    """A :class:`BadInput`'s ``make``: the valid call's keyword arguments (``valid_args()``, new
    tensors each time) with ``change(args)`` in place of each argument that ``changes`` names, in
    its order."""
    def make():
        args = valid_args()
        for name, change in changes.items():
            args[name] = change(args)
        return (), args
    return make


def compile_every_variant(op_package: str, count: int) -> Callable[[], None]:
    """A provider's ``compile_variants`` for an op whose ``cuda_impl`` lists its variants
    (``all_kernel_names()``, ``count`` distinct ones) and compiles several as one program: all
    of them for sm_90 (raises where one fails)."""
    def compile_variants() -> None:
        cuda_impl = importlib.import_module(f"{op_package}.cuda_impl")
        names = cuda_impl.all_kernel_names()
        obj, _ = cuda_impl.compile_kernel("sm_90", names)  # one program: raises if any fails
        assert len(names) == len(set(names)) == count and len(bytes(obj.code)) > 0
    return compile_variants


def small_tiles(base, *changes: dict) -> tuple[Example, ...]:
    """A provider's ``small_tile_cases``: ``base`` (a case dataclass with an ``id``) with each of
    ``changes`` (``dataclasses.replace`` keywords), named by the new case's ``id``."""
    cases = [dataclasses.replace(base, **change) for change in changes]
    return tuple(Example(c.id, c) for c in cases)


def _default_check(names: Sequence[str]):
    def check(case, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
        for name, g, w in zip(names, got, want, strict=True):
            assert_caches_equal(g, w, name)
    return check


@dataclasses.dataclass(frozen=True)
class Provider:
    """What the conformance suite needs of one op.

    ``call(*args, implementation=...)`` is the op's public function; ``build(case, device,
    seed)`` its positional arguments for ``case`` (caches filled with random bytes over their
    whole allocations); ``mutates`` the positions of the arguments it writes (named
    ``mutated_names`` in failures); ``check(case, got, want)`` compares the written arguments
    byte for byte (default: every byte of each allocation). ``skip(info, case, args)`` says why an
    implementation cannot run a case (None: it can). ``compiled`` is what ``torch.compile``
    must capture (default: the op itself, once)."""
    op: str
    call: Callable[..., Any]
    build: Callable[[Any, str, int], tuple]
    mutates: tuple[int, ...]
    mutated_names: tuple[str, ...]
    check: Callable[[Any, Sequence[torch.Tensor], Sequence[torch.Tensor]], None] | None = None
    skip: Callable[[registry.ImplInfo, Any, tuple], str | None] | None = None
    # For CUDA-graph replay, where it refuses more (default: ``skip``).
    graph_skip: Callable[[registry.ImplInfo, Any, tuple], str | None] | None = None
    reference: str = "torch"
    # The public function as users call it (bad input's keyword calls; default ``call``).
    public: Callable[..., Any] | None = None
    # The case of the new inputs a graph replay copies in (default: the captured case; e.g. other
    # scale values where the case fixes them).
    replay_case: Callable[[Any], Any] | None = None
    # The seed of the captured call's inputs, then those of the new ones copied in before each
    # replay.
    graph_seeds: tuple[int, ...] = (1, 2)
    # Run the call once before the capture (False: the variant's first call is in the capture).
    graph_warmup: bool = True
    # More to check of the arguments after a replay (beyond the bytes against the reference).
    graph_check: Callable[[tuple], None] | None = None
    cases: tuple[Example, ...] = ()
    # Small tiles for the Triton implementation at forced warps: the op's calls at small head
    # sizes (8, 10, 16 where the op takes them) and few tokens, and the smallest call that
    # reaches each of its kernels (Triton 3.6 wrote wrong bytes in one-warp programs on small
    # tiles only). Run on the GPU at 1 and 2 warps, and once under the interpreter to show that
    # they launch every kernel.
    small_tile_cases: tuple[Example, ...] = ()
    graph_cases: tuple[Example, ...] = ()
    compile_cases: tuple[Example, ...] = ()
    compiled: tuple[str, ...] | None = None
    wrong_writers: tuple[WrongWriter, ...] = ()
    bad_inputs: tuple[BadInput, ...] = ()
    # Compiles every CUDA variant of the op with NVRTC (no GPU needed); raises if one fails.
    compile_variants: Callable[[], None] | None = None
    # Where ``build`` returns something other than the public function's arguments (e.g. one
    # inputs object of several entry points): every tensor of a call, the written ones, and
    # the call with the written ones replaced (defaults: by position, from ``mutates``).
    tensors_of: Callable[[tuple], list[torch.Tensor]] | None = None
    written_of: Callable[[tuple], list[torch.Tensor]] | None = None
    with_written: Callable[[tuple, list[torch.Tensor]], tuple] | None = None

    def compare(self, case, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
        (self.check or _default_check(self.mutated_names))(case, got, want)

    def why_not(self, info: registry.ImplInfo, case, args: tuple, graph: bool = False
                ) -> str | None:
        skip = (self.graph_skip or self.skip) if graph else self.skip
        return None if skip is None else skip(info, case, args)

    @property
    def byte_cases(self) -> tuple[Example, ...]:
        """The cases of the bytes-against-the-reference test: ``cases`` where given, else the
        torch.compile cases and (on the GPU) the graph cases."""
        if self.cases:
            return self.cases
        return (*self.compile_cases,
                *(dataclasses.replace(ex, gpu=True) for ex in self.graph_cases))

    @property
    def compiled_targets(self) -> list[str]:
        return list(self.compiled) if self.compiled is not None else [f"kvwrite.{self.op}"]


def _module_name(op: str) -> str:
    return f"{__package__}.providers.{op}"


def provider(op: str) -> Provider:
    """The provider of ``op`` (ImportError naming the module where it has none)."""
    return importlib.import_module(_module_name(op)).PROVIDER


def missing_providers() -> list[str]:
    """Registered ops without a provider module."""
    import kvwrite.ops  # noqa: F401  (registers every op)
    missing = []
    for op in registry.ops():
        try:
            provider(op)
        except ModuleNotFoundError as e:
            if e.name != _module_name(op):
                raise
            missing.append(op)
    return missing


def providers() -> list[Provider]:
    """The provider of every registered op that has one (``missing_providers`` lists the rest)."""
    import kvwrite.ops  # noqa: F401
    gone = set(missing_providers())
    return [provider(op) for op in registry.ops() if op not in gone]


def tensors(p: Provider, args: tuple) -> list[torch.Tensor]:
    """Every tensor of a call (inputs, slots, scales, written arguments)."""
    if p.tensors_of is not None:
        return p.tensors_of(args)
    return [a for a in args if isinstance(a, torch.Tensor)]


def written(p: Provider, args: tuple) -> list[torch.Tensor]:
    """The tensors the call writes."""
    if p.written_of is not None:
        return p.written_of(args)
    return [args[i] for i in p.mutates]


def run_reference(p: Provider, args: tuple) -> list[torch.Tensor]:
    """The reference implementation's writes for ``args``, into copies of the whole allocations
    of the written tensors; ``args`` are unchanged."""
    moved, copies = with_copies(p, args)
    p.call(*moved, implementation=p.reference)
    return copies


def with_copies(p: Provider, args: tuple) -> tuple[tuple, list[torch.Tensor]]:
    """``args`` with the written tensors replaced by copies of their whole allocations, and the
    copies."""
    copies = copy_allocations(written(p, args))
    if p.with_written is not None:
        return p.with_written(args, copies), copies
    moved = list(args)
    for i, c in zip(p.mutates, copies, strict=True):
        moved[i] = c
    return tuple(moved), copies


def snapshot(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every tensor given, in tuples too (not on the meta device), with a copy of its
    allocation's bytes."""
    from .compare import storage_bytes
    given = []
    for a in (*args, *kwargs.values()):
        given += list(a) if isinstance(a, tuple) else [a]
    return [(t, storage_bytes(t).clone()) for t in given
            if isinstance(t, torch.Tensor) and t.device.type != "meta"]


def unchanged(snap: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    from .compare import storage_bytes
    return all(torch.equal(storage_bytes(t), b) for t, b in snap)
