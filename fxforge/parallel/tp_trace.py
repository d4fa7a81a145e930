"""The forward graph a tensor-parallel plan is read from, with every submodule call's inputs and outputs marked.

:func:`trace_forward` traces one training step of the model on fake tensors
(:func:`fxforge.training.step_graph.trace_step`: AOTAutograd's ATen graphs, nothing runs on real data) and
keeps its forward graph. While it traces, hooks on every submodule pass each floating-point tensor the
submodule receives or returns through ``aten.alias``, annotated with the submodule and the slot (positional
index or keyword name) or output index. So the graph says exactly which value enters which submodule by
which argument, and which value a submodule returns: what ``PrepareModuleInput`` and ``PrepareModuleOutput``
need, and where each ``nn.Linear`` call begins and ends. The aliases are views that change nothing.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> traced = trace_forward(model, (torch.randn(2, 8),))
    >>> [(c.module, len(c.inputs), len(c.outputs)) for c in traced.calls_of("0")]
    [('0', 1, 1)]
    >>> traced.module_of(traced.calls_of("2")[0].outputs[0])
    '2'
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

from fxforge.capture.inputs import normalize_inputs
from fxforge.training.step_graph import StepGraphs, module_of, trace_step

ALIAS = torch.ops.aten.alias.default


@dataclasses.dataclass
class Call:
    """One call of a submodule in the forward graph.

    Attributes:
        module: the submodule's qualified name.
        inputs: slot (positional index or keyword) -> the alias node of the tensor it received there.
        outputs: output index -> the alias node of the tensor it returned there (a single tensor is index 0).
        positional: how many positional arguments the call had.
        arity: how many values it returned (1: a tensor; a tuple's length; 0: something else).
    """

    module: str
    inputs: dict[int | str, torch.fx.Node] = dataclasses.field(default_factory=dict)
    outputs: dict[int, torch.fx.Node] = dataclasses.field(default_factory=dict)
    positional: int = 0
    arity: int = 0


@dataclasses.dataclass
class TracedForward:
    """The forward graph with its calls (see the module docstring).

    Attributes:
        graph: the forward graph (``step.forward.graph``).
        step: the traced step (its backward graph too).
        calls: per submodule, its calls in order.
        parameters: parameter placeholder -> the parameter's name (the first of its names when tied).
        user_inputs: the placeholders of the model's own inputs.
    """

    graph: torch.fx.Graph
    step: StepGraphs
    calls: dict[str, list[Call]]
    parameters: dict[torch.fx.Node, str]
    user_inputs: list[torch.fx.Node]

    def calls_of(self, module: str) -> list[Call]:
        """The calls of ``module`` ([] when it never ran)."""
        return self.calls.get(module, [])

    @staticmethod
    def module_of(node: torch.fx.Node) -> str:
        """The innermost submodule running ``node`` ("" for the root)."""
        return module_of(node)

    def requires_grad(self, node: torch.fx.Node) -> bool:
        """Whether a gradient flows back to ``node``: it depends on a trainable parameter."""
        return node in self._grad_nodes

    def __post_init__(self) -> None:
        trainable = {n for n, t in zip(self.graph.find_nodes(op="placeholder"), self.step.trainable) if t}
        grad: set[torch.fx.Node] = set()
        for node in self.graph.nodes:
            if node in trainable or (node.op == "call_function" and any(i in grad for i in node.all_input_nodes)):
                value = node.meta.get("val")
                leaves = value if isinstance(value, (tuple, list)) else (value,)
                if any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves):
                    grad.add(node)
        self._grad_nodes = grad


def slot_of(node: torch.fx.Node) -> tuple[str, int | str] | None:
    """``(module, slot)`` when ``node`` is the alias marking a tensor a submodule received, else None."""
    custom = node.meta.get("custom") or {}
    where = custom.get("tp_slot") if node.target is ALIAS else None
    return None if where is None else (where[0], where[1])


def output_of(node: torch.fx.Node) -> tuple[str, int] | None:
    """``(module, index)`` when ``node`` is the alias marking a tensor a submodule returned, else None."""
    custom = node.meta.get("custom") or {}
    where = custom.get("tp_out") if node.target is ALIAS else None
    return None if where is None else (where[0], where[1])


def is_marker(node: torch.fx.Node) -> bool:
    """Whether ``node`` is one of the aliases the trace added (an identity)."""
    return slot_of(node) is not None or output_of(node) is not None


def base_of(node: torch.fx.Node) -> torch.fx.Node:
    """``node`` with the trace's markers in front of it skipped: the node that computed the value."""
    while is_marker(node):
        node = node.args[0]
    return node


def value_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that use the value of ``node``, looking through the trace's markers (which are not listed).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> traced = trace_forward(model, (torch.randn(2, 4),))
        >>> [(u.name, traced.module_of(u)) for u in value_users(traced.user_inputs[0]) if u.op != "output"]
        [('addmm', '0')]
    """
    found, stack = [], list(node.users)
    while stack:
        user = stack.pop(0)
        if is_marker(user):
            stack.extend(user.users)
        else:
            found.append(user)
    return found


def _tag(value: Any, key: str, where: tuple[str, Any]) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        with fx_traceback.annotate({key: where}):
            return ALIAS(value)
    return value


def _hooks(model: nn.Module) -> list[Any]:
    handles = []
    count: dict[str, int] = {}

    def pre(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            call = count[name] = count.get(name, -1) + 1
            return (tuple(_tag(a, "tp_slot", (name, i, call, len(args))) for i, a in enumerate(args)),
                    {k: _tag(v, "tp_slot", (name, k, call, len(args))) for k, v in kwargs.items()})
        return hook

    def post(name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            call = count[name]
            if isinstance(output, torch.Tensor):
                return _tag(output, "tp_out", (name, 0, call, 1))
            if type(output) in (tuple, list):
                return type(output)(_tag(o, "tp_out", (name, i, call, len(output))) for i, o in enumerate(output))
            return output
        return hook

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(post(name)))
    return handles


def trace_forward(model: nn.Module, example_inputs: Any) -> TracedForward:
    """Trace ``model``'s forward on fake copies of ``example_inputs`` with its submodule calls marked.

    Args:
        model: the model (its mode decides dropout, as in eager; it is left as it was).
        example_inputs: a tuple of positional inputs, one tensor, or a dict of keyword inputs.
    """
    args, kwargs = normalize_inputs(example_inputs)
    handles = _hooks(model)
    try:
        # As torch.export does while it traces: libraries then take their trace-friendly paths (transformers
        # skips checks that read tensor values, which fake tensors do not have).
        with torch.compiler._compile_session_context():
            step = trace_step(model, args, kwargs, loss=None)
    finally:
        for handle in handles:
            handle.remove()
    graph = step.forward.graph
    # AOTAutograd runs the forward more than once; the graph keeps the last run's calls (their numbers
    # continue the earlier runs'), so calls are told apart by the number each carries.
    by_number: dict[tuple[str, int], Call] = {}
    for node in graph.nodes:
        for key in ("tp_slot", "tp_out"):
            where = (node.meta.get("custom") or {}).get(key) if node.target is ALIAS else None
            if where is None:
                continue
            call = by_number.setdefault((where[0], where[2]), Call(where[0]))
            if key == "tp_slot":
                call.inputs[where[1]] = node
                call.positional = where[3]
            else:
                call.outputs[where[1]] = node
                call.arity = where[3]
    calls: dict[str, list[Call]] = {}
    for (module, _), call in sorted(by_number.items()):
        calls.setdefault(module, []).append(call)
    placeholders = list(graph.find_nodes(op="placeholder"))
    n_params = len(step.parameter_names)
    parameters = {node: name for node, name in zip(placeholders[:n_params], step.parameter_names)}
    user_inputs = placeholders[n_params + len(step.buffer_names):]
    return TracedForward(graph, step, calls, parameters, user_inputs)
