"""reshape_and_cache's benchmark on the engine (``kvwrite-bench reshape_and_cache``): the legacy
paged-attention layout (key ``[num_blocks, H, D/x, block_size, x]``, value ``[num_blocks, H, D,
block_size]``). The seed benchmark's flags, points, inputs (vLLM's recipe) and bytes, with these
caches (zeroed, x = 16 bytes / element size) in place of the flash layouts; its layout axis is
"legacy". The check: the implementation and the torch reference each write a copy of a cache of
the same shape with just enough blocks for the point's tokens (the point's slots remapped to
unique slots of it), and every byte of both copies must be equal.
"""

from __future__ import annotations

import dataclasses

import torch

from ... import registry
from ...ops.reshape_and_cache import OP, create_legacy_kv_cache, validate
from .. import engine
from ..engine import compare_with_reference
from ..workload import make_input_sets
from .reshape_and_cache_flash import ReshapeAndCacheFlashBench

__all__ = ["BENCH"]


class ReshapeAndCacheBench(ReshapeAndCacheFlashBench):
    name = OP
    summary = "the legacy paged-attention cache write (x-packed key layout)"
    description = ("Benchmark reshape_and_cache (the legacy paged-attention layout): the seed "
                   "benchmark's flags and points with key [num_blocks, H, D/x, block_size, x] and "
                   "value [num_blocks, H, D, block_size] caches.")
    op = OP
    cpu_defaults = {"num_heads": 8, "num_blocks": 16, "num_tokens": "2:64", **engine.CPU_TIMING}
    columns = (("num_tokens", "num_tokens"),)
    always_columns = ("num_tokens",)

    def add_flags(self, p) -> None:
        super().add_flags(p)
        p.set_defaults(num_blocks=8192, layouts="legacy")

    def configure(self, args, device) -> None:
        if args.layouts != "legacy":
            raise ValueError(f"--layouts: reshape_and_cache has one layout, legacy; got "
                             f"{args.layouts!r}")
        args.layouts = "NHD"  # the seed's points; the caches below replace its layouts
        super().configure(args, device)

    def params(self, p) -> dict:
        return {**super().params(p), "layout": "legacy"}

    def _legacy_caches(self, c, num_blocks: int, device):
        dtype = c.cache_tensor_dtype
        return create_legacy_kv_cache(num_blocks, c.block_size, c.num_heads, c.head_size,
                                      dtype, device=device)

    def prepare(self, p, count: int, device):
        c = p.case
        with engine.skip_unless_fits():
            sets = make_input_sets(c, c.num_tokens, count, device)
        caches = self._legacy_caches(c, c.num_blocks, device)
        s0 = sets[0]
        validate(s0.key, s0.value, *caches, s0.slot_mapping, c.kv_cache_dtype, s0.k_scale,
                 s0.v_scale)
        return p, caches, sets

    def release(self) -> None:
        pass

    def unsupported(self, ctx, kind, impl) -> str | None:
        p, (key_cache, _), sets = ctx
        return registry.get(OP, impl).unsupported(sets[0].key, key_cache, p.case.cache_dtype,
                                                  sets[0].k_scale)

    def check(self, ctx, kind, impl) -> str | None:
        p, caches, sets = ctx
        c, s = p.case, sets[0]
        real = s.slot_mapping >= 0
        blocks = -(-int(real.sum()) // c.block_size) + 1
        small = self._legacy_caches(c, blocks, caches[0].device)
        slots = s.slot_mapping.clone()
        gen = torch.Generator(device="cpu").manual_seed(0)
        slots[real] = torch.randperm(blocks * c.block_size, generator=gen)[:int(real.sum())].to(
            slots.device, slots.dtype)
        args = dataclasses.replace(s, slot_mapping=slots).run_args
        cd = c.cache_dtype

        def writer(name):
            run = registry.get(OP, name).run
            return lambda out: run(*args(out["key_cache"], out["value_cache"], cd))
        nan = {"key_cache": cd.fp8_dtype, "value_cache": cd.fp8_dtype} if cd.is_fp8 else None
        return compare_with_reference(writer(impl), writer("torch"),
                                      {"key_cache": small[0], "value_cache": small[1]}, nan)

    def call(self, ctx, kind, impl):
        p, (key_cache, value_cache), sets = ctx
        run = registry.get(OP, impl).run
        args = [s.run_args(key_cache, value_cache, p.case.cache_dtype) for s in sets]

        def call(i: int) -> None:
            run(*args[i % len(args)])
        return call


BENCH = ReshapeAndCacheBench()
