"""registry.define_op and registry.custom_op, on a toy op declared here under a throwaway name: the
registry entry and its implementations, the torch.library custom op and its fake, the re-entry
while torch.compile traces, and the errors of a bad declaration."""

from __future__ import annotations

import enum
import inspect
import itertools
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kvwrite import registry
from kvwrite.testing.compile import compiled_targets

_serial = itertools.count()


def _name(kind: str) -> str:
    """A fresh op name (torch.library cannot forget an op, so no two tests share one)."""
    return f"spine_toy_{kind}_{next(_serial)}"


@pytest.fixture
def toy_package(monkeypatch):
    """A package ``spine_toy_pkg`` whose three implementation modules record the calls they run
    and refuse a case where ``refuse[name]`` says why; the registry entries made through it are
    removed afterwards."""
    calls, refuse = [], {}
    for impl in registry.STANDARD_IMPLS:
        mod = types.ModuleType(f"spine_toy_pkg.{impl.module}")
        mod.available = lambda device: None
        mod.unsupported = lambda *case, name=impl.name: refuse.get(name)
        mod.run = lambda *args, name=impl.name: calls.append((name, args))
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    ops, impls = dict(registry._OPS), dict(registry._REGISTRY)
    yield types.SimpleNamespace(name="spine_toy_pkg", calls=calls, refuse=refuse)
    registry._OPS.clear()
    registry._OPS.update(ops)
    registry._REGISTRY.clear()
    registry._REGISTRY.update(impls)


def _declare(name, package, **kw):
    kw = {"torch": "toy reference", "triton": "toy kernel", **kw}
    return registry.define_op(name, package, run="x, out", unsupported="x", **kw)


def test_define_op_registers_the_op_and_three_implementations(toy_package):
    name = _name("reg")
    bench = registry.BenchCommand("toy", "kvwrite.bench.ops.toy:BENCH", "a toy")
    spec = _declare(name, toy_package.name, torch_syncs="a toy sync", bench=bench)
    assert registry.get_op(name) is spec
    assert (spec.run_signature, spec.unsupported_signature, spec.bench) == (
        "run(x, out) -> None", "unsupported(x) -> str | None", bench)
    got = [(i.name, i.priority, i.module, i.devices, i.requires, i.graph_safe, i.description)
           for i in registry.all_impls(name)]
    assert got == [
        ("cuda", 20, "spine_toy_pkg.cuda_impl", ("cuda",), (), True, registry.NVRTC_KERNEL),
        ("triton", 10, "spine_toy_pkg.triton_impl", ("cuda",), ("triton",), True, "toy kernel"),
        ("torch", 0, "spine_toy_pkg.reference", ("cpu", "cuda"), (), False, "toy reference"),
    ]
    # Without a host sync the reference is graph-safe; a cuda description replaces the default.
    other = _name("reg")
    _declare(other, toy_package.name, cuda="toy cuda")
    assert [(i.graph_safe, i.description) for i in registry.all_impls(other)] == [
        (True, "toy cuda"), (True, "toy kernel"), (True, "toy reference")]
    assert [s.name for s in registry.implementations("cpu", op=name)] == ["cuda", "triton", "torch"]


def test_a_detail_continues_the_standard_description(toy_package):
    """A description opening with "(", "," or ":" continues the implementation's standard one;
    any other replaces it; cuda's standard one stands where none is given."""
    name = _name("detail")
    _declare(name, toy_package.name, torch="(toy rows)", triton=": a tile of rows",
             cuda=", a lane group per row")
    assert [i.description for i in registry.all_impls(name)] == [
        registry.NVRTC_KERNEL + ", a lane group per row", "Triton kernel: a tile of rows",
        "plain PyTorch (toy rows); the reference"]
    assert registry.bench("toy", "a toy", module="toys", aliases=("t",)) == registry.BenchCommand(
        "toy", "kvwrite.bench.ops.toys:BENCH", "a toy", ("t",))
    assert registry.bench("toy", "a toy").target == "kvwrite.bench.ops.toy:BENCH"


def test_dispatch_picks_the_preferred_implementation_that_can_run(toy_package):
    name = _name("select")
    _declare(name, toy_package.name)
    on_gpu = types.SimpleNamespace(device=torch.device("cuda"))
    assert registry.select(name, (on_gpu,)).name == "cuda"
    toy_package.refuse["cuda"] = "too wide"
    assert registry.select(name, (on_gpu,)).name == "triton"
    # The CPU: only the reference is meant for it, whatever the priorities.
    assert registry.select(name, (torch.zeros(1),)).name == "torch"
    registry.select(name, (torch.zeros(1),)).run(1, 2)
    assert toy_package.calls == [("torch", (1, 2))]
    with pytest.raises(ValueError, match="implementation='cuda' cannot run this call: too wide"):
        registry.select(name, (on_gpu,), "cuda")


@pytest.mark.parametrize("kw, match", [
    ({"cuda_impl": "x"}, r"descriptions: expected implementation names \['torch', 'triton', "
                         r"'cuda'\], got \['cuda_impl'\]"),
    ({"triton": None}, r"expected a description of each implementation .*none for \['triton'\]"),
])
def test_a_bad_declaration_is_refused_and_registers_nothing(toy_package, kw, match):
    name = _name("bad")
    kw = {"torch": "toy reference", "triton": "toy kernel", **kw}
    kw = {k: v for k, v in kw.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        registry.define_op(name, toy_package.name, run="x", unsupported="x", **kw)
    assert name not in registry.ops()


def test_an_op_is_declared_once(toy_package):
    name = _name("twice")
    _declare(name, toy_package.name)
    with pytest.raises(ValueError, match=f"op '{name}' is already registered"):
        _declare(name, toy_package.name)


class Mode(enum.Enum):
    A = "a"
    B = "b"


def _toy_op(name, seen):
    @registry.custom_op(name, mutates=("out",), args={"count": registry.INT})
    def toy(x: torch.Tensor, out: torch.Tensor, count: int, kind: str = "a",
            scale: torch.Tensor | None = None, *, tag: str | None = None, eps: float = 0.5,
            implementation: str | None = None) -> None:
        """A toy op: out = x * count (+ eps where kind is "b")."""
        seen.append((count, kind, scale, tag, eps, implementation))
        out.copy_(x * count + (eps if kind in ("b", Mode.B) else 0.0))

    return toy


def test_custom_op_registers_the_schema_derived_from_the_signature():
    name, seen = _name("op"), []
    toy = _toy_op(name, seen)
    op = getattr(torch.ops.kvwrite, name)
    assert str(op.default._schema) == (
        f"kvwrite::{name}(Tensor x, Tensor(a1!) out, SymInt count, str kind, Tensor? scale, "
        f"str? tag, float eps, str implementation) -> ()")
    # The public function keeps its name, signature and docstring, and runs as itself.
    assert toy.__name__ == "toy" and toy.__doc__.startswith("A toy op")
    assert str(inspect.signature(toy)) == str(inspect.signature(toy.__wrapped__))
    x, out = torch.arange(4.0), torch.zeros(4)
    toy(x, out, 2, Mode.B, implementation=None)
    assert seen == [(2, Mode.B, None, None, 0.5, None)] and out.tolist() == [0.5, 2.5, 4.5, 6.5]


def test_the_fake_returns_none_and_writes_nothing():
    name, seen = _name("fake"), []
    toy = _toy_op(name, seen)
    # Registered, not the trivial one torch would make up for an op without a fake.
    assert toy.custom_op._abstract_fn is not None
    with FakeTensorMode():
        x, out = torch.zeros(4), torch.zeros(4)
        assert getattr(torch.ops.kvwrite, name)(x, out, 2, "a", None, None, 0.5, "") is None
    assert seen == []


def test_torch_compile_sees_one_mutating_custom_op_with_the_arguments_lowered():
    name, seen = _name("compile"), []
    toy = _toy_op(name, seen)

    def step(x, out):
        toy(x, out, 3, Mode.B, tag=Mode.A, eps=1)

    x, out = torch.arange(4.0), torch.zeros(4)
    assert compiled_targets(step, x, out) == [f"kvwrite.{name}"]
    # Inside the op: enums as their values, the int converted, the float a float, and
    # implementation None again.
    assert seen == [(3, "b", None, "a", 1.0, None)]
    assert out.tolist() == [1.0, 4.0, 7.0, 10.0]
    torch._dynamo.reset()
    out = torch.zeros(4)
    torch.compile(step, fullgraph=True, backend="aot_eager")(x, out)
    assert out.tolist() == [1.0, 4.0, 7.0, 10.0]


def test_a_traced_call_binds_its_arguments_as_python_does():
    name, seen = _name("bind"), []
    toy = _toy_op(name, seen)

    def missing(x, out):
        toy(x, out)

    def unknown(x, out):
        toy(x, out, 1, colour="red")

    for fn, match in ((missing, "toy\\(\\) missing required argument: 'count'"),
                      (unknown, "toy\\(\\) got an unexpected keyword argument 'colour'")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=match):
            torch.compile(fn, fullgraph=True, backend="eager")(torch.zeros(2), torch.zeros(2))
    assert seen == []


@pytest.mark.parametrize("make, match", [
    (lambda name: registry.custom_op(name, mutates=("y",)), r"mutates: expected arguments of the "
                                                             r"op \['x', 'implementation'\], got \['y'\]"),
    (lambda name: registry.custom_op(name, mutates=(), args={"z": registry.INT}),
     r"args: expected arguments of toy, got \['z'\]"),
    (lambda name: registry.custom_op(name, mutates=(), lower=lambda *a: a),
     "expected both lower and entry, or neither"),
])
def test_a_bad_custom_op_declaration_is_refused(make, match):
    name = _name("badop")
    with pytest.raises(ValueError, match=match):
        @make(name)
        def toy(x: torch.Tensor, implementation: str | None = None) -> None:
            pass
    assert not hasattr(torch.ops.kvwrite, name)


def test_an_argument_without_a_known_crossing_is_refused():
    name = _name("noann")
    with pytest.raises(ValueError, match=r"kind: expected an annotation among .* or an entry in "
                                         r"args, got none"):
        @registry.custom_op(name, mutates=())
        def toy(x: torch.Tensor, kind=None) -> None:
            pass


def test_an_entry_and_a_lowering_cross_a_call_whole():
    """Where arguments do not cross one at a time (a pair given as a tuple), ``lower`` maps the
    bound call (defaults filled in) to the entry's arguments, and the entry calls the function."""
    name, seen = _name("entry"), []

    def lower(pair, scale, implementation):
        return pair[0], pair[1], float(scale), implementation or ""

    def entry(a: torch.Tensor, b: torch.Tensor, scale: float, implementation: str) -> None:
        toy((a, b), scale, implementation=implementation or None)

    @registry.custom_op(name, mutates=("b",), lower=lower, entry=entry)
    def toy(pair, scale=2, *, implementation: str | None = None) -> None:
        seen.append((type(pair), scale, implementation))
        pair[1].copy_(pair[0] * scale)

    op = getattr(torch.ops.kvwrite, name)
    assert str(op.default._schema) == (
        f"kvwrite::{name}(Tensor a, Tensor(a1!) b, float scale, str implementation) -> ()")

    def step(a, b):
        toy((a, b))

    a, b = torch.arange(3.0), torch.zeros(3)
    assert compiled_targets(step, a, b) == [f"kvwrite.{name}"]
    assert seen == [(tuple, 2.0, None)] and b.tolist() == [0.0, 2.0, 4.0]
