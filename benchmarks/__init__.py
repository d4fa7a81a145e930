"""fxforge's benchmarks: one harness, one section protocol.

``python -m benchmarks --suite NAME [options]`` runs a section (:mod:`benchmarks.harness`);
``python -m benchmarks --list`` lists them (:data:`benchmarks.sections.SECTIONS`); every section is a
:class:`benchmarks.section.Section` (name, description, ``add_arguments(parser)``, ``run(args)``).
Without ``--suite``, the ``default`` section compares eager, torch.compile, ONNX Runtime and fxforge on
the default models of the suite (:mod:`benchmarks.timed`). Results go to ``benchmarks/out/`` (JSON) and
each section's own block of ``benchmarks/RESULTS.md`` (:mod:`benchmarks.report`).

- the timed sections (:mod:`benchmarks.timed`, measured by :mod:`benchmarks.rounds`): ``default``,
  ``conv``, ``attention`` (with peak memory, :mod:`benchmarks.memory`), ``onnx``, ``targets``;
- ``dynamic`` (a trace of changing shapes), ``training`` (a step's memory and checkpointing),
  ``pipeline`` (pipeline splits), ``zoo`` (torchvision and timm), ``onnx-forms`` (the ORT kernel
  choices), ``optimize-time`` (first-time optimize in new processes), ``against`` (this checkout
  against another), ``guard-overhead``, ``memory-reorder``.
"""
