"""What every op's memcheck cases share (``tools/sanitize/<op>.py`` in the repository, run by
``python -m tools.sanitize`` under compute-sanitizer): a case is ``(id, run)``, where ``run()`` calls the op's cuda
implementation on the GPU over a bounds-stressing input and the torch reference on the CPU over
the same input, and returns None when every output allocation holds the same bytes, else what
differs (:func:`compare_outputs`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .compare import assert_caches_equal

__all__ = ["SanitizeCase", "compare_outputs"]

SanitizeCase = tuple[str, Callable[[], "str | None"]]


def compare_outputs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                    nan_dtypes: dict[str, torch.dtype] | None = None) -> str | None:
    """None when each named tensor's whole allocation in ``got`` (any device) holds the bytes of
    the one in ``want``; else the first difference. ``nan_dtypes[name]``: elements of that dtype
    that decode to NaN in both count as equal (fp8 NaN codes of either sign)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    nan_dtypes = nan_dtypes or {}
    for name, w in want.items():
        try:
            assert_caches_equal(got[name], w, name, nan_dtypes.get(name),
                                nan_equal=name in nan_dtypes)
        except AssertionError as e:
            return str(e)
    return None
