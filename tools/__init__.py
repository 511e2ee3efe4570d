"""Tools of this repository, not installed with kvwrite: run them from the checkout's root, with
kvwrite installed (``pip install -e .``) or ``PYTHONPATH=src``.

    python -m tools.probes NAME [...]   # development probes (tools/probes)
    python -m tools.sanitize [--ops ...] # every op's bounds cases, for compute-sanitizer
"""
