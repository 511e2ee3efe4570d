"""One module per registered op, named after it, each declaring ``PROVIDER`` (a
:class:`kvwrite.testing.conformance.Provider`): the op's cases for the conformance suite
(tests/test_conformance.py)."""
