"""Argument checks shared by every public op: each raises TypeError or ValueError naming the
argument, what was expected and what came, before anything is written."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence

import torch

__all__ = ["shape_str", "require_tensor", "require_same_device", "check_slot_dtype",
           "check_like", "check_in_range", "check_at_most", "check_token_indices", "check_count", "check_int", "check_mutation_safe",
           "spans_its_storage"]


def shape_str(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def require_same_device(device: torch.device, what: str, named: tuple) -> None:
    """Every ``(name, tensor)`` of ``named`` is on ``device`` (``what`` names whose device it is)."""
    for name, t in named:
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (that of {what}), got {t.device}")


def check_like(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor, *props: str) -> None:
    """``t`` has the ``props`` ("shape", "dtype", "strides") of ``like``, checked in that order."""
    for prop in props:
        if prop not in ("shape", "dtype", "strides"):
            raise ValueError(f"check_like: expected props among shape, dtype, strides, got {prop!r}")
        if prop == "shape" and t.shape != like.shape:
            raise ValueError(f"{name}: expected the shape of {like_name} {shape_str(like)}, got "
                             f"{shape_str(t)}")
        if prop == "dtype" and t.dtype != like.dtype:
            raise ValueError(f"{name}: expected the dtype of {like_name} ({like.dtype}), got "
                             f"{t.dtype}")
        if prop == "strides" and t.stride() != like.stride():
            raise ValueError(f"{name}: expected the strides of {like_name} {tuple(like.stride())}, "
                             f"got {tuple(t.stride())}")


def check_slot_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: expected dtype int64 or int32, got {t.dtype}")


def check_at_most(name: str, t: torch.Tensor, rows: int, rows_of: str) -> None:
    """``t`` has at most ``rows`` entries (``rows_of``: what bounds them, as the message names it,
    e.g. "key.shape[0]")."""
    if t.numel() > rows:
        raise ValueError(f"{name}: expected at most {rows_of} = {rows} entries, got {t.numel()}")


def check_token_indices(name: str, t: torch.Tensor, rows: int | None = None,
                        rows_of: str = "") -> None:
    """``t`` (slots, positions): 1 dim ``[num_tokens]``, int64 or int32, contiguous, and where
    ``rows`` is given at most that many entries (:func:`check_at_most`)."""
    if t.dim() != 1:
        raise ValueError(f"{name}: expected 1 dim [num_tokens], got shape {shape_str(t)}")
    check_slot_dtype(name, t)
    if t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous tensor, got stride {t.stride(0)}")
    if rows is not None:
        check_at_most(name, t, rows, rows_of)


def check_reader_slots(name: str, t, device: torch.device, device_of: str) -> None:
    """A reader's slot list: a tensor of 1 dim ``[num_tokens]``, int64 or int32, on ``device``
    (that of ``device_of``, the cache it reads); any stride."""
    require_tensor(name, t)
    if t.dim() != 1:
        raise ValueError(f"{name}: expected 1 dim [num_tokens], got shape {shape_str(t)}")
    check_slot_dtype(name, t)
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (that of {device_of}), got {t.device}")


def check_in_range(name: str, t: torch.Tensor, bad: torch.Tensor, expected: str,
                   at: str = "positions") -> None:
    """Raise ValueError naming the entries of ``t`` where the boolean ``bad`` holds (the first
    16: their indices and values): "``name``: ``expected``; N out of range at ``at`` [...] with
    values [...]". Reads them on the host (a sync): for debugging and tests, not the hot path."""
    where = torch.nonzero(bad).flatten().cpu()
    if where.numel():
        shown = where[:16].tolist()
        values = t.cpu()[where[:16]].tolist()
        more = f" (and {where.numel() - len(shown)} more)" if where.numel() > len(shown) else ""
        raise ValueError(f"{name}: {expected}; {where.numel()} out of range at {at} {shown} with "
                         f"values {values}{more}")


def check_int(name: str, n, least: int = 0) -> int:
    """``n`` as an int >= ``least`` (any integer type; not bool, float or str)."""
    what = "a non-negative int" if least == 0 else f"an int >= {least}"
    if isinstance(n, bool):
        raise TypeError(f"{name}: expected {what}, got bool")
    try:
        value = operator.index(n)
    except TypeError:
        raise TypeError(f"{name}: expected {what}, got {type(n).__name__}") from None
    if value < least:
        raise ValueError(f"{name}: expected {what}, got {value}")
    return int(value)


def check_count(name: str, n) -> int:
    """``n`` as a non-negative int (any integer type; not bool, float or str)."""
    return check_int(name, n)


# --- writes in place: what every op checks of the tensors it writes and reads -------------------

# Tensors up to this many elements whose strides the fast rule cannot clear are checked exactly,
# offset by offset; larger ones are refused as possibly overlapping.
EXACT_OVERLAP_LIMIT = 1 << 22

_Dims = tuple  # ((size, stride_in_bytes), ...): sizes > 1, strides > 0, outermost first


def _byte_geometry(t: torch.Tensor) -> tuple[int, _Dims, int]:
    """``(first byte address, dims, run)``: the elements of ``t`` are the byte ranges
    ``[base + sum(i_k * stride_k), ... + run)`` over the dims (the innermost contiguous dims are
    merged into ``run``). A dim of stride 0 stays (size > 1): it makes elements coincide."""
    dims, run, shift = _layout(tuple(t.shape), tuple(t.stride()), t.element_size())
    return t.data_ptr() + shift, dims, run


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple, stride: tuple, es: int) -> tuple[_Dims, int, int]:
    """``(dims, run, base shift)`` of a shape and strides (see :func:`_byte_geometry`); cached:
    the same caches and views come back call after call."""
    shift = 0
    dims = []
    for size, st in zip(shape, stride, strict=True):
        if size == 1:
            continue
        if st < 0:
            shift += st * (size - 1) * es
            st = -st
        dims.append((size, st * es))
    dims.sort(key=lambda d: d[1])
    run = es
    while dims and dims[0][1] == run:
        run *= dims[0][0]
        dims.pop(0)
    return tuple(reversed(dims)), run, shift


def _extent(dims: _Dims, run: int) -> int:
    return sum((n - 1) * s for n, s in dims) + run


def spans_its_storage(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements reach from the first byte of its storage to the last (no other
    view can share the storage without overlapping ``t``); an empty tensor does."""
    if t.numel() == 0:
        return True
    dims, run, shift = _layout(tuple(t.shape), tuple(t.stride()), t.element_size())
    return (t.storage_offset() * t.element_size() + shift == 0
            and _extent(dims, run) == t.untyped_storage().nbytes())


def _offsets(base: int, dims: _Dims) -> torch.Tensor:
    off = torch.tensor([base], dtype=torch.int64)
    for n, s in dims:
        off = (off[:, None] + torch.arange(n, dtype=torch.int64) * s).flatten()
    return off


def _count(dims: _Dims) -> int:
    return math.prod(n for n, _ in dims)


@functools.lru_cache(maxsize=4096)
def _self_overlap(dims: _Dims, run: int) -> bool | None:
    """Whether two elements share a byte (None: too large to tell exactly)."""
    ext = run
    for n, s in reversed(dims):  # innermost first: each stride must clear the dims inside it
        if s < ext:
            break
        ext += (n - 1) * s
    else:
        return False
    if any(s == 0 for _, s in dims):
        return True
    if _count(dims) > EXACT_OVERLAP_LIMIT:
        return None
    off = torch.sort(_offsets(0, dims)).values
    return bool((off[1:] - off[:-1] < run).any())


def _overlap(a: tuple[int, _Dims, int], b: tuple[int, _Dims, int]) -> bool | None:
    """Whether two tensors' elements share a byte, each free of self-overlap (None: too large
    to tell exactly)."""
    (ba, da, ra), (bb, db, rb) = a, b
    return _relative_overlap(bb - ba, da, ra, db, rb)


@functools.lru_cache(maxsize=4096)
def _relative_overlap(delta: int, da: _Dims, ra: int, db: _Dims, rb: int) -> bool | None:
    """:func:`_overlap` of ``a`` at address 0 and ``b`` at ``delta`` (cached: it depends only on
    the two geometries and their distance). Outer dims of equal stride that clear both inner
    extents are peeled off: only the one or two index differences whose slices can meet are
    followed."""
    ba, bb = 0, delta
    ext_a, ext_b = _extent(da, ra), _extent(db, rb)
    if ba + ext_a <= bb or bb + ext_b <= ba:
        return False
    if not da and not db:
        return True
    if da and db and da[0][1] == db[0][1]:
        (na, stride), (nb, _) = da[0], db[0]
        in_a, in_b = _extent(da[1:], ra), _extent(db[1:], rb)
        if stride >= in_a and stride >= in_b:
            delta = bb - ba
            # Slices a[i] and b[j] meet only if (i - j) * stride lies in (delta - in_a, delta + in_b).
            lo = max((delta - in_a) // stride + 1, -(nb - 1))
            hi = min(-((-(delta + in_b)) // stride) - 1, na - 1)
            unknown = False
            for k in range(lo, hi + 1):
                r = _overlap((ba + k * stride, da[1:], ra), (bb, db[1:], rb))
                if r:
                    return True
                unknown |= r is None
            return None if unknown else False
    if _count(da) + _count(db) > EXACT_OVERLAP_LIMIT:
        return None
    starts_a = torch.sort(_offsets(ba, da)).values
    starts_b = _offsets(bb, db)
    # For each element of b, the last element of a starting before b's end must end past b's start.
    i = torch.searchsorted(starts_a, starts_b + rb) - 1
    hit = (i >= 0) & (starts_a[i.clamp(min=0)] + ra > starts_b)
    return bool(hit.any())


def check_mutation_safe(outputs: Sequence[tuple[str, torch.Tensor]],
                        inputs: Sequence[tuple[str, torch.Tensor | None]] = ()) -> None:
    """The rule every op applies to the tensors it writes in place (``outputs``) and reads
    (``inputs``, None entries ignored), before anything is written:

    - no meta tensor (it has no memory to write or read);
    - no output that requires grad (the ops write in place and are not differentiable), and no
      input that requires grad while grad mode is on (call the op under ``torch.no_grad()`` or
      ``torch.inference_mode()``, or pass ``.detach()``);
    - no inference tensor written outside ``torch.inference_mode()``;
    - no output whose elements share memory (a stride 0 over a dim of size > 1, or strides that
      fold elements onto each other), no two outputs that share memory (``st[:-1]`` and
      ``st[1:]``), and no input that shares memory with an output. Tensors that only interleave
      (K and V blocks of one allocation, K and V halves of a packed last dim) pass.

    Raises ValueError naming the tensor, what was expected and what came.
    """
    named_in = [(n, t) for n, t in inputs if t is not None]
    device = {}
    for name, t in (*outputs, *named_in):
        device[name] = d = t.device
        if d.type == "meta":
            raise ValueError(f"{name}: expected a tensor with memory (cpu or cuda), got a meta "
                             f"tensor (meta tensors are not supported)")
    inference_mode = torch.is_inference_mode_enabled()
    for name, t in outputs:
        if t.requires_grad:
            raise ValueError(f"{name}: expected a tensor that does not require grad (it is written "
                             f"in place and the op is not differentiable), got requires_grad=True")
        if not inference_mode and t.is_inference():
            raise ValueError(f"{name}: expected a tensor writable here, got an inference tensor "
                             f"(made under torch.inference_mode()) outside inference mode: call "
                             f"the op inside torch.inference_mode(), or make {name} outside it")
    if torch.is_grad_enabled():
        for name, t in named_in:
            if t.requires_grad:
                raise ValueError(f"{name}: expected a tensor that does not require grad (the op is "
                                 f"not differentiable), got requires_grad=True with grad mode on: "
                                 f"call it under torch.no_grad() or torch.inference_mode(), or "
                                 f"pass {name}.detach()")
    geo = {}
    written = []
    for name, t in outputs:
        if t.numel() == 0:
            continue
        geo[name] = g = _byte_geometry(t)
        written.append((name, t))
        over = _self_overlap(g[1], g[2])
        if over is not False:
            what = ("elements that share memory" if over else
                    f"strides that this check cannot prove free of overlap at {t.numel()} elements")
            raise ValueError(f"{name}: expected every element in its own memory, got strides "
                             f"{tuple(t.stride())} for shape {shape_str(t)}: {what}")
    pairs = [(written[i], written[j]) for i in range(len(written))
             for j in range(i + 1, len(written))]
    pairs += [(o, i) for i in named_in if i[1].numel() for o in written]
    spans = {}
    for (on, o), (other, t) in pairs:
        # Tensors whose allocations lie apart cannot share memory: only the others are compared.
        if device[on] != device[other]:
            continue
        for n, x in ((on, o), (other, t)):
            if n not in spans:
                st = x.untyped_storage()
                spans[n] = (st.data_ptr(), st.data_ptr() + st.nbytes())
        if spans[on][1] <= spans[other][0] or spans[other][1] <= spans[on][0]:
            continue
        if other not in geo:
            geo[other] = _byte_geometry(t)
        over = _overlap(geo[on], geo[other])
        if over is not False:
            what = "overlapping memory" if over else "memory that this check cannot prove apart"
            raise ValueError(f"{other}: expected memory apart from {on}'s, got {what}")
