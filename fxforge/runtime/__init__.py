"""The runtime: what happens per call, and what is measured while a graph runs.

- :mod:`~fxforge.runtime.plans`: ``PlanCache``, one plan per input signature, run per call (eager fallback);
- :mod:`~fxforge.runtime.plan_policy`: ``ShapePolicy`` and the limits on plans; :mod:`~fxforge.runtime.fallbacks`:
  the warnings an eager fallback gives;
- :mod:`~fxforge.runtime.native`: ``OptimizedModule`` and decorated classes, the model's own nn.Module face;
- :mod:`~fxforge.runtime.signature`: what about a call a plan is specialised to;
- :mod:`~fxforge.runtime.memory`: peak memory measured on a real run;
- :mod:`~fxforge.runtime.roofline`: this machine's peak compute and bandwidth;
- :mod:`~fxforge.runtime.profile`: time, FLOPs, bytes and memory node by node.
"""
