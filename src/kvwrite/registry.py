"""The registry of implementations.

Every implementation exposes one function with the same signature::

    run(key, value, key_cache, value_cache, slot_mapping, cache_dtype: CacheDType,
        k_scale, v_scale) -> None

called only with arguments the public op has validated (see :mod:`kvwrite.op`): fp8 caches may
be ``torch.uint8`` or the matching float8 dtype, scales are float32 tensors of 1 or H elements
(``None`` outside fp8 modes). It must do no host sync and no allocation on the hot path unless its
entry says it is not graph-safe.

An entry says which devices it runs on, whether it can run here at all (``available``) and whether
it can run one particular case (``unsupported``), each as ``None`` or a reason string. The tests and
the benchmark iterate the registry, so a new implementation is tested and benchmarked as soon as it
registers.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch

__all__ = ["ImplInfo", "ImplStatus", "register", "get", "all_impls", "implementations"]

RunFn = Callable[..., None]


@dataclasses.dataclass(frozen=True)
class ImplInfo:
    name: str
    description: str
    # Module that defines `run`, `available(device) -> str | None` and
    # `unsupported(key, key_cache, cache_dtype, k_scale) -> str | None`; imported lazily so that
    # importing kvwrite never pulls in triton or cuda.core.
    module: str
    # Higher wins when the caller names no implementation.
    priority: int
    # Device types this implementation is meant for; a call that names no implementation only
    # picks among these (Triton's CPU interpreter is for tests, not for default use).
    devices: tuple[str, ...] = ("cuda",)
    # Safe to capture in a CUDA graph (no host sync, no allocation per call).
    graph_safe: bool = True

    def _mod(self):
        return importlib.import_module(self.module)

    @property
    def run(self) -> RunFn:
        return self._mod().run

    def available(self, device: torch.device | str) -> str | None:
        """None if this implementation can run on `device` here, else the reason it cannot."""
        try:
            mod = self._mod()
        except ImportError as e:  # a missing optional dependency
            return f"{self.name}: cannot import {self.module}: {e}"
        return mod.available(torch.device(device))

    def unsupported(self, key: torch.Tensor, key_cache: torch.Tensor, cache_dtype,
                    k_scale: torch.Tensor | None) -> str | None:
        """None if this implementation can run this (validated) case, else the reason."""
        reason = self.available(key.device)
        if reason is not None:
            return reason
        return self._mod().unsupported(key, key_cache, cache_dtype, k_scale)


@dataclasses.dataclass(frozen=True)
class ImplStatus:
    name: str
    available: bool
    reason: str | None
    description: str


_REGISTRY: dict[str, ImplInfo] = {}


def register(info: ImplInfo) -> ImplInfo:
    if info.name in _REGISTRY:
        raise ValueError(f"implementation {info.name!r} is already registered")
    _REGISTRY[info.name] = info
    return info


def get(name: str) -> ImplInfo:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"implementation: expected one of {sorted(_REGISTRY)}, got {name!r}"
        ) from None


def all_impls() -> list[ImplInfo]:
    """Every registered implementation, preferred first."""
    return sorted(_REGISTRY.values(), key=lambda i: -i.priority)


def implementations(device: torch.device | str | None = None) -> list[ImplStatus]:
    """Each registered implementation, whether it can run on `device` here, and why not.

    `device` defaults to "cuda" when PyTorch sees a GPU, else "cpu".
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for info in all_impls():
        reason = info.available(device)
        out.append(ImplStatus(info.name, reason is None, reason, info.description))
    return out


register(ImplInfo(
    name="torch",
    description="plain PyTorch (index_put_ with padding and bounds masked); the reference",
    module="kvwrite.impls.torch_ref",
    priority=0,
    devices=("cpu", "cuda"),
    # Boolean masking of padding/out-of-range slots syncs with the host.
    graph_safe=False,
))
register(ImplInfo(
    name="triton",
    description="Triton kernel, every layout and fp8 mode",
    module="kvwrite.impls.triton_impl",
    priority=10,
))
register(ImplInfo(
    name="cuda",
    description="CUDA C++ kernel compiled at run time with NVRTC (cuda.core)",
    module="kvwrite.impls.cuda_impl",
    priority=20,
))
