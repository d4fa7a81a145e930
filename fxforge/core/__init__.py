"""The shared vocabulary of every stage; it imports nothing else of fxforge.

- :mod:`~fxforge.core.captured`: ``Captured``, the value that flows through the stages, and ``LoweredRun``;
- :mod:`~fxforge.core.plan`: ``Plan``, a rewritten graph and what runs it;
- :mod:`~fxforge.core.report`: what a capture and its rewrites did, and why;
- :mod:`~fxforge.core.nodes`: facts about fx nodes (effects, views, in-place ops) and graph copies;
- :mod:`~fxforge.core.vocabulary`: every call form of the ops the stages read, one name per op, and the
  signatures the pattern engine binds them to;
- :mod:`~fxforge.core.source`: the user's source line of a node or an error;
- :mod:`~fxforge.core.shapes`: shape metadata (``meta["val"]``) on every node;
- :mod:`~fxforge.core.verify`: "the same results": output comparison, isolated runs, random inputs;
- :mod:`~fxforge.core.memory`: the simulated memory model (live activation bytes, node by node);
- :mod:`~fxforge.core.costs`: the cost model (a node's FLOPs, bytes and roofline seconds on a ``Machine``);
- :mod:`~fxforge.core.units`: byte sizes and budgets as people write them (``"2GiB"``, ``"60%"``);
- :mod:`~fxforge.core.draw`: pictures of a graph;
- :mod:`~fxforge.core.files`, :mod:`~fxforge.core.disk_cache`, :mod:`~fxforge.core.tensor_cache`: files written
  whole, measurements remembered on disk, values derived from tensors.
"""
