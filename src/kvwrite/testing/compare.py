"""The one byte comparison of kvwrite's tests and benchmark checks: every byte through integer
views, so NaN bit patterns, signed zeros and stray writes are all seen; optionally two elements
that both decode to NaN (any sign or payload) count as equal, as the fp8 rule allows."""

from __future__ import annotations

import torch

__all__ = ["storage_bytes", "copy_allocations", "nan_mask", "differing_bytes",
           "assert_caches_equal"]


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole allocation behind `t` as a flat uint8 tensor (a view, not a copy)."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),))


def copy_allocations(tensors, device: str | torch.device | None = None,
                     copy: bool = True) -> list[torch.Tensor | None]:
    """Each tensor (None stays None) rebuilt on a copy of its whole allocation (on ``device``,
    default its own), with its shape, strides and offset: bytes outside the view come along, and
    tensors that share one allocation share one copy. ``copy=False`` moves without copying where
    the device is already right."""
    copies: dict[tuple, torch.Tensor] = {}

    def rebuild(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in copies:
            c = storage_bytes(t).to(t.device if device is None else device, copy=copy)
            # A copy in host memory of a pinned allocation is pinned too (a GPU op may take it
            # beside a device side only so).
            copies[key] = c.pin_memory() if c.device.type == "cpu" and t.is_pinned() else c
        return copies[key].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    return [rebuild(t) for t in tensors]


def nan_mask(bytes_: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per byte of a uint8 tensor holding elements of ``dtype`` (in order, from its first byte):
    does the element that holds it decode to NaN. Bytes of a last, partial element: False."""
    es = torch.empty(0, dtype=dtype).element_size()
    flat = bytes_.reshape(-1)
    if dtype == torch.uint8:
        return torch.zeros_like(bytes_, dtype=torch.bool)
    n = flat.numel() // es
    m = torch.isnan(flat[: n * es].view(dtype).float()).repeat_interleave(es)
    tail = torch.zeros(flat.numel() - n * es, dtype=torch.bool, device=m.device)
    return torch.cat([m, tail]).view(bytes_.shape)


def differing_bytes(actual: torch.Tensor, expected: torch.Tensor,
                    nan_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Bool mask of the bytes where two uint8 tensors of one shape differ. With ``nan_dtype``,
    bytes of elements that decode to NaN in both (any sign or payload) count as equal."""
    diff = actual != expected
    if nan_dtype is None or nan_dtype == torch.uint8 or not bool(diff.any()):
        return diff
    return diff & ~(nan_mask(actual, nan_dtype) & nan_mask(expected, nan_dtype))


def assert_caches_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "cache",
                        fp8_dtype: torch.dtype | None = None, nan_equal: bool = False) -> None:
    """Compare every byte of the storage behind `actual` and `expected`.

    The whole allocation is compared, so stray writes outside the target slots (and into the
    other half of an interleaved or packed cache) are caught. With ``nan_equal``, two elements
    that both decode to NaN (with any sign or payload) count as equal; ``fp8_dtype`` says how to
    decode uint8 caches for that.
    """
    a, e = storage_bytes(actual).cpu(), storage_bytes(expected).cpu()
    if a.numel() != e.numel():
        raise AssertionError(f"{name}: storage sizes differ ({a.numel()} vs {e.numel()} bytes)")
    decode = fp8_dtype if expected.dtype == torch.uint8 else expected.dtype
    diff = differing_bytes(a, e, decode if nan_equal else None)
    if diff.any():
        idx = torch.nonzero(diff).flatten()
        es = expected.element_size()
        first = idx[:8].tolist()
        raise AssertionError(
            f"{name}: {idx.numel()} bytes differ; first at byte offsets {first} "
            f"(element {[i // es for i in first]}): got {a[idx[:8]].tolist()}, expected {e[idx[:8]].tolist()}"
        )
