"""One module per implementation; each exposes `run`, `available` and `unsupported` (see
:mod:`kvwrite.registry`)."""
