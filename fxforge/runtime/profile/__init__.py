"""Profiling: a graph's time, FLOPs, bytes and memory, node by node (``fxforge.profile``).

- :mod:`~fxforge.runtime.profile.measure`: :func:`profile_graph`, the measurement itself;
- :mod:`~fxforge.runtime.profile.runner`: runs the graph node by node (time, FLOPs, bytes, live memory);
- :mod:`~fxforge.runtime.profile.flops`: torch's FLOP counter with the formulas of :mod:`fxforge.core.costs`;
- :mod:`~fxforge.runtime.profile.op_names`: each node's op, named by :mod:`fxforge.core.vocabulary`;
- :mod:`~fxforge.runtime.profile.modules`: the user's module each node belongs to;
- :mod:`~fxforge.runtime.profile.table`: :class:`Profile`, the table and its summaries;
- :mod:`~fxforge.runtime.profile.graphs`: a model TorchDynamo cuts into graphs, each graph's nodes in one table;
- :mod:`~fxforge.runtime.profile.plots`: matplotlib plots of a profile.

Example:
    >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(2, 8),), warmup=0, repeat=1)
    >>> type(p).__name__, list(p.table["op"])
    ('Profile', ['linear'])
"""

from fxforge.runtime.profile.graphs import GraphsProfile
from fxforge.runtime.profile.measure import profile_graph
from fxforge.runtime.profile.table import Profile

__all__ = ["GraphsProfile", "Profile", "profile_graph"]
