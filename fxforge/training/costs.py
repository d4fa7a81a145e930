"""What recomputing a forward node costs: the cost model of :mod:`fxforge.core.costs`, under its old name.

The roofline estimate (``max(flops / peak, bytes / bandwidth) + launch``, FLOPs by torch's formulas, views
free, elementwise ops fused under Inductor) is one model shared with the profiler and the pipeline planner;
it lives in :mod:`fxforge.core.costs`. This module only keeps the two names
:mod:`fxforge.training.checkpointing` imports from here until it imports them from core.

Example:
    >>> from fxforge.core import costs
    >>> node_seconds is costs.node_seconds and graph_seconds is costs.graph_seconds
    True
"""

from __future__ import annotations

from fxforge.core.costs import graph_seconds, node_seconds

__all__ = ["graph_seconds", "node_seconds"]
