"""Spreading a training step over devices: pipeline stages, tensor-parallel plans, data parallel and fully
sharded training, the mesh planner and the local launcher.

- :func:`fxforge.partition` (:mod:`fxforge.parallel.partition`) cuts a model into cost-balanced pipeline
  stages on ``torch.distributed.pipelining``; :func:`fxforge.parallel.launch.run_pipeline` runs them.
- :func:`fxforge.parallelize` (:mod:`fxforge.parallel.planner`) prices every mesh of data parallel, fully
  sharded, tensor parallel and pipeline parallelism and picks the fastest that fits; :func:`run` runs a
  plan on local processes and checks it against the model in one.

Example:
    >>> from fxforge.parallel.strategy import meshes, name
    >>> [name(m) for m in meshes(2, tp_degrees=(2,), pipeline=False)]
    ['dp2', 'fsdp2', 'tp2']
"""

import importlib
from typing import Any


def run(plan: Any, example_inputs: Any, steps: int = 1, **options: Any) -> Any:
    """Run ``plan`` (from :func:`fxforge.parallelize`) on local processes and check it against the model in
    this one: :func:`fxforge.parallel.mesh_run.run`; returns a :class:`~fxforge.parallel.mesh_run.MeshRun`
    (``.max_error``, ``.grad_error``, ``.step_s``, ``.comm_bytes``, ``.memory_per_device``).

    Example (slow: starts processes)::

        result = fxforge.parallel.run(fxforge.parallelize(model, (x,), devices=2), (x,), steps=3)
    """
    from fxforge.parallel.mesh_run import run as run_plan

    return run_plan(plan, example_inputs, steps, **options)


__all__ = ["Partition", "partition", "run"]


def __getattr__(name: str) -> Any:
    # Imported on first use: a worker process importing fxforge.parallel.worker needs no partitioner.
    if name in ("Partition", "partition"):
        return getattr(importlib.import_module("fxforge.parallel.partition"), name)
    raise AttributeError(f"module 'fxforge.parallel' has no attribute {name!r}")
