"""Each op's benchmark definition (an :class:`~kvwrite.bench.engine.OpBench` named ``BENCH``), one
module per ``kvwrite-bench`` subcommand; the op's ``registry.BenchCommand`` names it
(``kvwrite.bench.ops.<name>:BENCH``) and the CLI imports it only when its subcommand runs."""
