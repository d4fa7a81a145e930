"""The fxforge comparison harness.

``python -m benchmarks`` builds every model of the suite (:mod:`benchmarks.suite`), prepares every
contender (:mod:`benchmarks.contenders`) on it, times them in one run with interleaved repetitions and
medians (:mod:`benchmarks.run`), and writes ``benchmarks/out/results.json`` plus the harness block of
``benchmarks/RESULTS.md`` (:mod:`benchmarks.report`).
"""
