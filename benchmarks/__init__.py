"""The fxforge comparison harness.

``python -m benchmarks`` builds every model of the suite (:mod:`benchmarks.suite`), prepares every
contender (:mod:`benchmarks.contenders`) on it, times them in one run with interleaved repetitions and
medians (:mod:`benchmarks.run`), and writes ``benchmarks/out/results.json`` plus the harness block of
``benchmarks/RESULTS.md`` (:mod:`benchmarks.report`).

``python -m benchmarks --suite conv`` runs a section instead (the convolutional models at batch 1 and 8
against ``optimize_for_inference`` and torch.compile): ``benchmarks/out/results-conv.json`` and its own
block of ``RESULTS.md``, with summary lines under its table. ``--suite attention`` runs the BERT encoder
at S = 512 / 1024 / 2048 and the LLaMA decoder at S = 2048 against torch.compile, with latency and peak
memory (:mod:`benchmarks.memory`).
"""
