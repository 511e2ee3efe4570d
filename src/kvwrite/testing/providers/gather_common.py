"""What the conformance providers of the five gathers share: a graph case as a function of the
seed, the output comparison, wrong writers as the reference with its ``run`` replaced, and the
Provider built from those (each gather's row rule against an independent oracle:
tests/test_gather.py)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import kvwrite

from ..conformance import BadInput, Example, Provider, WrongWriter, compile_every_variant
from ..gather import Seqs, assert_outputs_equal

__all__ = ["gather_provider", "via_reference", "reference_run", "SMALL_SEQS"]

# The small tiles' requests: three of at most 3 rows (one empty) over blocks of 4.
SMALL_SEQS = Seqs(lens=(2, 0, 3), starts=(1, 0, 2), block_size=4, num_blocks=4)


def reference_run(op: str) -> Callable:
    """The torch reference's own ``run`` of ``op`` (the wrong writers wrap it)."""
    return importlib.import_module(f"kvwrite.ops.{op}.reference").run


def via_reference(op: str, broken: Callable) -> Callable[..., None]:
    """A wrong writer: the public function with the torch implementation, whose ``run`` is
    ``broken`` for this one call."""
    ref = importlib.import_module(f"kvwrite.ops.{op}.reference")

    def write(*args) -> None:
        real = ref.run
        ref.run = broken
        try:
            getattr(kvwrite, op)(*args, implementation="torch")
        finally:
            ref.run = real
    return write


def gather_provider(op: str, make: Callable, args_of: Callable, mutates: tuple[int, ...],
                    names: tuple[str, ...], nan, wrong: tuple[WrongWriter, ...],
                    bad: tuple[BadInput, ...], graph_cases: tuple[Example, ...],
                    compile_cases: tuple[Example, ...], variants: int,
                    small_tile_cases: tuple[Example, ...] = ()) -> Provider:
    """``make(case, device)`` builds a case's inputs, ``args_of(inputs, case)`` the call's
    arguments; ``nan``: which output columns may hold any NaN (assert_outputs_equal's
    ``nan_cols``). A graph case is a function of the seed (0 and 1: new lengths, starts, block
    ids and scales between them). ``variants``: how many CUDA variants the op compiles."""
    def build(case, device, seed):
        case = case(seed) if callable(case) else case
        return args_of(make(case, device), case)

    def check(case, got, want) -> None:
        for name, g, w in zip(names, got, want, strict=True):
            assert_outputs_equal(g, w, f"{op} {name}", nan)

    return Provider(op=op, call=getattr(kvwrite, op), build=build, mutates=mutates,
                    mutated_names=names, check=check, graph_seeds=(0, 1),
                    graph_cases=graph_cases, compile_cases=compile_cases,
                    small_tile_cases=small_tile_cases, wrong_writers=wrong,
                    bad_inputs=bad,
                    compile_variants=compile_every_variant(f"kvwrite.ops.{op}", variants))
