"""The ``native`` target: the rewritten graph run by PyTorch, fused ops calling the kernels autotune chose.

What it builds is an :class:`~fxforge.runtime.native.OptimizedModule` (or, for a class, a subclass whose
instances optimize themselves): the model itself, not a snapshot (live weights, hooks, gradients, training
mode, one plan per input signature or one shape-generic plan for the sizes that change). It writes a
``.pt2`` (``torch.export`` program of the rewritten graph) and runs checkpointed training steps op by op.

Example:
    >>> opt = NATIVE.build(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()).eval(), (torch.ones(2, 3),), {})
    >>> type(opt).__name__, opt.report.method
    ('OptimizedModule', 'fx')
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from fxforge.capture import normalize_inputs
from fxforge.core.accuracy import Tolerance
from fxforge.exporters.export import dynamic_capture
from fxforge.exporters.pt2 import NativeExport, save_native
from fxforge.lowering import build
from fxforge.lowering.build import Lowering, plan_builder
from fxforge.lowering.precision_stage import precision_dtype
from fxforge.runtime.cuda_graphs import cuda_graph_builder
from fxforge.runtime.dynamo import DynamoRunner, one_graph_needed
from fxforge.runtime.interop_choice import inter_op_builder
from fxforge.runtime.native import DynamoFactory, OptimizedModule, optimize_class
from fxforge.runtime.plans import MAX_PLANS, ShapePolicy
from fxforge.runtime.race import Entrant
from fxforge.runtime.throughput import serve_throughput
from fxforge.runtime.throughput_search import SEARCH_BUDGET_S
from fxforge.targets.base import Contract, Target, model_kind, prepared
from fxforge.training.module import checkpointed

# What the plan builder takes of a target's options.
_PLAN_OPTIONS = ("rewrites", "verify", "method", "tuning", "precision", "tolerance")


class NativeTarget(Target):
    """PyTorch runs the rewritten graph (see the module docstring); :attr:`lowering` says how a rewritten graph
    becomes a plan, :attr:`compiled_training` whether a checkpointed step's graphs are compiled."""

    name = "native"
    summary = "the rewritten graph run by PyTorch (fused oneDNN/cuDNN kernels chosen by autotune)"
    contract = Contract(dynamic="every size: one plan per signature, or one with the dims that change dynamic",
                        artifact=".pt2")
    options = ("tuning", "dynamic_shapes", "max_plans", "precision", "tolerance", "inter_op", "cuda_graphs",
               "objective", "throughput_budget_s")
    precisions = ("bf16", "bfloat16", "fp16", "float16", "int8", "auto")
    lowering: Lowering = build.NATIVE
    compiled_training = False

    def build(self, model: Any, example_inputs: Any, options: dict[str, Any]) -> nn.Module | type:
        policy = ShapePolicy(options.get("dynamic"), options.get("dynamic_shapes"),
                             options.get("max_plans", MAX_PLANS))
        plan_options = {k: options[k] for k in _PLAN_OPTIONS if k in options}
        if "precision" in plan_options:  # (checked before anything runs)
            precision = plan_options["precision"]
            if precision_dtype(precision) is not None and precision not in self.precisions:
                raise ValueError(f"target={self.name!r} takes precision={' or '.join(map(repr, self.precisions))}, "
                                 f"not {precision!r}; every precision runs on target='native'")
            Tolerance.of(plan_options.get("tolerance"))
        method = plan_options.pop("method", "auto")
        if method != "dynamo":
            plan_options["method"] = method
        plan_options["inter_op"] = inter_op_option(options.get("inter_op", True))
        plan_options["cuda_graphs"] = inter_op_option(options.get("cuda_graphs", True), "cuda_graphs")
        dynamo = self.dynamo_factory(plan_options, policy)
        if model_kind(model) == "class":
            return optimize_class(model, functools.partial(native_builder, lowering=self.lowering, **plan_options),
                                  policy, dynamo, method)
        module = OptimizedModule(model, native_builder(model, lowering=self.lowering, **plan_options), policy,
                                 dynamo, method)
        module.__dict__["fxforge_options"] = dict(options)
        if example_inputs is not None:
            args, kwargs = normalize_inputs(example_inputs)
            module.prepare(*args, **kwargs)
        if options.get("objective") == "throughput":  # served by the streams x threads x batch measured fastest
            return serve_throughput(module, example_inputs, budget_s=options.get("throughput_budget_s",
                                                                                 SEARCH_BUDGET_S))
        return module

    def dynamo_factory(self, plan_options: dict[str, Any], policy: ShapePolicy) -> DynamoFactory:
        """How a model with graph breaks runs: TorchDynamo cuts it, and each graph between its breaks is built by
        this target's plan builder (its lowering: native kernels, or Inductor) with the same options."""
        return functools.partial(_dynamo_runner, self.lowering, {**plan_options, "method": "auto"}, policy)

    def write(self, built: nn.Module, path: str, *, dynamic_batch: bool = False) -> NativeExport:
        """The latest plan's rewritten graph as a ``.pt2`` (:func:`~fxforge.exporters.pt2.save_native`),
        loaded back and checked. A graph ``torch.export`` captured with the example's sizes is captured again
        with the batch dim dynamic first (``dynamic_batch``) and rewritten with the same rewrites."""
        captured = built.captured
        runner = getattr(built, "dynamo", None)
        if runner is not None:
            raise ValueError(one_graph_needed(type(built.original).__name__, "a .pt2 file", runner.report.breaks))
        if captured is None:
            raise ValueError("nothing to write: the module has not been prepared for any inputs")
        if dynamic_batch and captured.method == "export":
            options = built.__dict__.get("fxforge_options", {})
            again = dynamic_capture(built.original, captured.example_args, captured.example_kwargs,
                                    reference=captured.example_outputs)
            captured = build.rewrite(again, options.get("rewrites", "default"), verify=options.get("verify", True))
        return save_native(captured, path, dynamic_batch=dynamic_batch)

    def checkpointed(self, model: Any, example_inputs: Any, memory_budget: Any, **options: Any) -> nn.Module:
        unknown = sorted(set(options) - {"optimizer", "loss", "autocast", "check"})
        if unknown:
            raise TypeError("memory_budget plans checkpointing for a training step; it takes optimizer=, loss=, "
                            f"autocast= and check=, not {', '.join(unknown)}")
        return checkpointed(model, example_inputs, memory_budget, compiled=self.compiled_training,
                            target=self.name, **options)

    def entrant(self, model: nn.Module, args: tuple, kwargs: dict, options: dict[str, Any],
                shared: dict[str, Any]) -> Entrant:
        def built(module: nn.Module, seconds: float) -> None:
            shared["nodes"] = module.report.nodes_after  # Inductor's compile estimate reads it

        return Entrant(self.name, lambda: prepared(self.build(model, None, options), args, kwargs), built=built)


def _dynamo_runner(lowering: Lowering, options: dict[str, Any], policy: ShapePolicy, forward: Any,
                   why: str) -> DynamoRunner:
    """A :class:`~fxforge.runtime.dynamo.DynamoRunner` of ``forward``'s model whose graphs are built with
    ``lowering`` and ``options`` (module-level, so that an optimized module pickles)."""
    return DynamoRunner(forward.__self__, forward, functools.partial(native_builder, lowering=lowering, **options),
                        policy, why)


def inter_op_option(value: Any, name: str = "inter_op") -> bool | str:
    """``inter_op=`` (or ``cuda_graphs=``) checked: True (used where it measures faster: the default), False
    (never), or ``"always"`` (untimed; outputs still checked).

    Example:
        >>> inter_op_option("always"), inter_op_option(False)
        ('always', False)
    """
    if value is True or value is False or (isinstance(value, str) and value == "always"):
        return value
    raise ValueError(f"{name} must be True, False or 'always', not {value!r}")


def native_builder(module: nn.Module, *, inter_op: bool | str = True, cuda_graphs: bool | str = True,
                   **options: Any) -> Any:
    """The plan builder of ``module`` (:func:`~fxforge.lowering.build.plan_builder` with ``options``), its plans'
    independent branches run at the same time (``inter_op``: :func:`~fxforge.runtime.interop_choice.inter_op_builder`)
    and its plans on CUDA replayed as CUDA graphs (``cuda_graphs``:
    :func:`~fxforge.runtime.cuda_graphs.cuda_graph_builder`), each where it measures faster (see
    :func:`inter_op_option`).

    Example:
        >>> from fxforge.core.plan import CallConditions
        >>> native_builder(torch.nn.ReLU(), inter_op=False)((torch.ones(1),), {}, CallConditions()).report.method
        'fx'
    """
    build = plan_builder(module, **options)
    if inter_op:
        build = inter_op_builder(build, always=inter_op == "always")
    if cuda_graphs:
        build = cuda_graph_builder(build, always=cuda_graphs == "always")
    return build


NATIVE = NativeTarget()
