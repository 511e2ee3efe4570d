"""The parametrizations the per-op test files share."""

from __future__ import annotations

import pytest

from kvwrite import registry

# The CPU, and a CUDA GPU (marked gpu: deselected, or skipped with the reason, where there is none).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def impl_names(op: str) -> list[str]:
    """Every registered implementation of ``op``, the preferred first."""
    return [info.name for info in registry.all_impls(op)]
