"""One package per op; importing one registers the op and its implementations."""

from . import reshape_and_cache_flash

__all__ = ["reshape_and_cache_flash"]
