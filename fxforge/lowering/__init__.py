"""Lowering: from a rewritten graph to what runs (a ``Plan``), with choices made by measurement.

- :mod:`~fxforge.lowering.kernels`: the fused ops' oneDNN and cuDNN kernels, registered with the ops;
- :mod:`~fxforge.lowering.autotune`: kernel, layout and keep-or-undo choices, timed on the real shapes;
- :mod:`~fxforge.lowering.timing`: interleaved timing with medians;
- :mod:`~fxforge.lowering.layout`: channels-last at the graph's entry and exit;
- :mod:`~fxforge.lowering.lower`: fused ops as direct kernel calls, and :func:`~fxforge.lowering.lower.make_plan`.
"""
