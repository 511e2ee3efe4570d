"""``python -m kvwrite.bench ...``: the same as ``kvwrite-bench ...`` (works from a checkout with
PYTHONPATH=src)."""

import sys

from .cli import main

sys.exit(main(prog="python -m kvwrite.bench"))
