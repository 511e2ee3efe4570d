"""``python -m kvwrite``: the version, and which implementation of each op can run here and why
not (``kvwrite.implementations()``)."""

from __future__ import annotations

import torch

from . import __version__, implementations
from .registry import installed


def main() -> int:
    triton = "installed" if installed("triton") else "not installed"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
    print(f"kvwrite {__version__} (torch {torch.__version__}, triton {triton}; {gpu})")
    print()
    print(implementations())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
