"""A split on PyTorch's pipelining engine: ``torch.distributed.pipelining.pipeline()`` at fxforge's split
points (:func:`build_pipe`), a microbatch run through its stages in this process to find the first that
fails (:func:`first_failing_stage`), and the search that refuses split points the engine cannot build or
run (:func:`_engine_split`).

Example:
    >>> from torch.distributed.pipelining import SplitPoint
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> microbatch = ((torch.randn(2, 4),), {})
    >>> pipe = build_pipe(model, microbatch, {"2": SplitPoint.BEGINNING}, 2)
    >>> pipe.num_stages, first_failing_stage(pipe, microbatch)
    (2, None)
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from fxforge.parallel.stage_outputs import outputs_from_last_stage
from fxforge.parallel.units import StageUnits

MAX_REFUSALS = 16
"""Split points refused on torch's engine before the search gives up."""


def _spec(names: list[str]) -> dict[str, Any]:
    from torch.distributed.pipelining import SplitPoint

    return {name: SplitPoint.BEGINNING for name in names}


def build_pipe(model: torch.nn.Module, microbatch: tuple[tuple[Any, ...], dict[str, Any]],
               split_spec: dict[str, Any], stages: int) -> Any:
    """``torch.distributed.pipelining.pipeline(model, ...)`` at ``split_spec``, undoing the split markers it
    wraps around the submodules' ``forward`` once traced, and checking it made ``stages`` stages.

    Raises:
        RuntimeError: the engine made another number of stages (torch.export traced the model differently).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> pipe = build_pipe(model, ((torch.randn(2, 4),), {}), _spec(["1"]), 2)
        >>> pipe.num_stages, hasattr(model[1], "_orig_forward")
        (2, False)
    """
    from torch.distributed.pipelining import pipeline

    try:
        with warnings.catch_warnings():  # pytree deprecations inside torch's own tracing
            warnings.simplefilter("ignore", FutureWarning)
            pipe = pipeline(model, microbatch[0], microbatch[1] or None, split_spec=split_spec)
    finally:
        for name in split_spec:
            module = model.get_submodule(name)
            if "_orig_forward" in module.__dict__:
                module.__dict__.pop("forward", None)
                del module.__dict__["_orig_forward"]
    if pipe.num_stages != stages:
        raise RuntimeError(f"torch.distributed.pipelining made {pipe.num_stages} stages of the split at "
                           f"{list(split_spec)}, not {stages}: torch.export traced the model differently from "
                           "fxforge's capture")
    outputs_from_last_stage(pipe)  # a model output an earlier stage computes is returned by the last
    for stage in range(stages):
        _send_contiguous(pipe.get_stage_module(stage))
    return pipe


def contiguous(value: Any) -> Any:
    """``value.contiguous()`` for a tensor, else ``value``: what a stage sends (gloo and NCCL send only
    contiguous tensors; a split inside attention sends transposed q and k).

    Example:
        >>> contiguous(torch.ones(2, 3).t()).is_contiguous(), contiguous(4)
        (True, 4)
    """
    return value.contiguous() if isinstance(value, torch.Tensor) else value


def _send_contiguous(stage: Any) -> None:
    """Make every tensor ``stage`` (a GraphModule of the pipe) returns contiguous, and say so in the
    metadata the engine sizes its send and receive buffers from (the outputs' and the inputs' ``val``)."""
    graph = stage.graph
    output = graph.output_node()

    def made_contiguous(node: torch.fx.Node) -> torch.fx.Node:
        new = graph.call_function(contiguous, (node,))
        if "val" in node.meta:
            new.meta["val"] = _contiguous_val(node.meta["val"])
        return new

    with graph.inserting_before(output):
        output.args = torch.fx.node.map_arg(output.args, made_contiguous)
    for placeholder in graph.find_nodes(op="placeholder"):
        if "val" in placeholder.meta:
            placeholder.meta["val"] = _contiguous_val(placeholder.meta["val"])
    stage.recompile()


def _contiguous_val(value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.is_contiguous():
        return value
    with contextlib.suppress(Exception):          # a fake tensor runs ``contiguous`` in its own mode
        return value.contiguous()
    return torch.empty(value.shape, dtype=value.dtype, device="meta")


def first_failing_stage(pipe: Any, microbatch: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[int, str] | None:
    """Run one microbatch through ``pipe``'s stages in this process, each stage receiving its inputs as
    the engine hands them over (detached leaves that require grad), and return the first stage that fails
    with the error's first line (None when all run). A stage that changes a received tensor in place
    (``x += residual`` right after a split) fails here as it would on the workers.

    The model's buffers (batch-norm statistics) and the random state are restored afterwards.

    Example:
        >>> class Residual(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         h = self.a(x)
        ...         return self.b(h) + h
        >>> microbatch = ((torch.randn(2, 4),), {})
        >>> first_failing_stage(build_pipe(Residual(), microbatch, _spec(["b"]), 2), microbatch) is None
        True
    """
    module = pipe.split_gm
    stage_names = [n.target for n in module.graph.nodes if n.op == "call_module"]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    placeholders = [n.target for n in module.graph.find_nodes(op="placeholder")]
    args, kwargs = microbatch
    inputs = list(args) + [kwargs[name] for name in placeholders[len(args):] if name in kwargs]

    class Handover(torch.fx.Interpreter):
        def call_module(self, target: Any, call_args: Any, call_kwargs: Any) -> Any:
            def received(value: Any) -> Any:
                if isinstance(value, torch.Tensor):
                    return value.detach().requires_grad_(value.requires_grad)
                return value

            call_args, call_kwargs = torch.utils._pytree.tree_map(received, (call_args, call_kwargs))
            try:
                return super().call_module(target, call_args, call_kwargs)
            except Exception as error:
                lines = [line for line in str(error).splitlines() if line.strip()]
                raise _StageFailed(stage_names.index(target), lines[0] if lines else type(error).__name__) from error

    try:
        with torch.random.fork_rng(), torch.enable_grad():
            Handover(module).run(*inputs)
    except _StageFailed as failed:
        return failed.stage, failed.reason
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    return None


class _StageFailed(Exception):
    def __init__(self, stage: int, reason: str):
        super().__init__(reason)
        self.stage, self.reason = stage, reason


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _engine_split(model: torch.nn.Module, units: StageUnits, stages: int,
                  search: Any) -> tuple[list[int], dict[str, str], Any]:
    """The best split (``search(forbidden units)``) that torch's engine builds and runs: a split point where
    ``pipeline()`` cannot split, or where the stage beginning there fails on one microbatch, is refused
    with the error, and the search runs again without it."""
    refused: dict[str, str] = {}
    for _ in range(MAX_REFUSALS + 1):
        cuts = search(frozenset(units.names.index(name) for name in refused))
        names = [units.names[c] for c in cuts]
        try:
            pipe = build_pipe(model, units.microbatch, _spec(names), stages)
        except Exception as error:  # noqa: BLE001 - torch's splitter failing is the answer, whatever it raises
            reason = f"torch.distributed.pipelining cannot split here ({_first_line(error)})"
            culprits = [n for n in names if not _builds(model, units, n)] if len(names) > 1 else names
            refused.update(dict.fromkeys(culprits or names, reason))
            continue
        failed = first_failing_stage(pipe, units.microbatch)
        if failed is None:
            return cuts, refused, pipe
        stage, reason = failed
        if stage == 0:
            raise RuntimeError(f"torch.distributed.pipelining cannot run this model's first stage ({reason}) at the "
                               f"split {names}")
        refused[names[stage - 1]] = reason
    raise RuntimeError(f"{len(refused)} split points failed on torch.distributed.pipelining; the last: "
                       f"{list(refused.values())[-1]}")


def _builds(model: torch.nn.Module, units: StageUnits, name: str) -> bool:
    try:
        build_pipe(model, units.microbatch, _spec([name]), 2)
    except Exception:  # noqa: BLE001
        return False
    return True
