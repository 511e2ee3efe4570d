"""One package per op; importing one registers the op and its implementations."""

from . import concat_and_cache_mla, reshape_and_cache_flash

__all__ = ["concat_and_cache_mla", "reshape_and_cache_flash"]
