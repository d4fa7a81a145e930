"""Symbolic tracing with an opaque-leaf fallback.

``torch.fx.symbolic_trace`` stops at the first thing a proxy cannot do (control flow on a traced value,
``x.dtype`` used as a Python value, item assignment on a proxy, ...). :func:`trace_with_leaves` traces,
finds the innermost submodule in which tracing broke, keeps that submodule opaque (a leaf called as a
whole), and traces again, until tracing succeeds or it breaks in the root module's own code.

Example:
    >>> import torch
    >>> result = trace_with_leaves(torch.nn.Sequential(torch.nn.ReLU()), (torch.ones(1),), {})
    >>> result.opaque
    []
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import os
import traceback
from typing import Any

import torch
from torch import nn

from fxforge.core.source import first_line, user_frame_of
from fxforge.core.tracing import ThreadBoundTracer, tracing
from fxforge.core.vocabulary import has_hooks


@dataclasses.dataclass(frozen=True)
class OpaqueModule:
    """A submodule kept as a leaf because tracing broke inside it.

    Attributes:
        name: the submodule's qualified name in the model (``encoder.layer.0``).
        type: its class name.
        reason: what broke tracing (exception type and first line).
        source: the user's line where it broke, ``file.py:12: code``.

    Example:
        >>> str(OpaqueModule("gate", "Gate", "TraceError: ...", "m.py:9: if x.sum() > 0:"))
        'gate (Gate): TraceError: ... at m.py:9: if x.sum() > 0:'
    """

    name: str
    type: str
    reason: str
    source: str | None

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        return f"{self.name} ({self.type}): {self.reason}{where}"


class TraceFailure(Exception):
    """Tracing broke in the root module's own code, so no leaf can help.

    Example:
        >>> str(TraceFailure("TraceError: x", "m.py:3"))
        'TraceError: x at m.py:3'
    """

    def __init__(self, reason: str, source: str | None, opaque: list[OpaqueModule] | None = None):
        super().__init__(f"{reason} at {source}" if source else reason)
        self.reason = reason
        self.source = source
        self.opaque = opaque or []


@dataclasses.dataclass
class TraceResult:
    """A traced GraphModule and the submodules that had to stay opaque.

    Example:
        >>> TraceResult(graph_module=None, opaque=[]).opaque
        []
    """

    graph_module: Any
    opaque: list[OpaqueModule]


# What a branch on a traced value may depend on to be decided from the example inputs' shapes alone.
SHAPE_METHODS = {"size", "dim", "ndimension", "numel"}
SHAPE_ATTRIBUTES = {"shape", "ndim", "dtype", "device", "is_cuda", "is_floating_point"}
SHAPE_FUNCTIONS = {getattr, operator.getitem, len, operator.not_, operator.truth, operator.neg,
                   *(getattr(operator, n) for n in ("eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul",
                                                    "floordiv", "truediv", "mod", "and_", "or_"))}


def shape_value(node: torch.fx.Node, inputs: dict[str, Any]) -> tuple[bool, Any]:
    """``(True, value)`` when ``node`` computes a Python value from input shapes, dtypes and devices only
    (``x.shape[1] != 3``), evaluated on ``inputs`` (placeholder name -> example value); ``(False, None)``
    when it depends on tensor data or on anything else.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> n = g.call_function(operator.getitem, (g.call_method("size", (x,)), 1))
        >>> shape_value(g.call_function(operator.ne, (n, 3)), {"x": torch.ones(2, 3)})
        (True, False)
    """
    values: dict[torch.fx.Node, Any] = {}

    def evaluate(n: torch.fx.Node) -> Any:
        if n in values:
            return values[n]
        if n.op == "placeholder":
            if n.target not in inputs:
                raise LookupError(n.target)
            result = inputs[n.target]
        elif (n.op == "call_method" and n.target in SHAPE_METHODS) or (
            n.op == "call_function" and n.target in SHAPE_FUNCTIONS
            and (n.target is not getattr or n.args[1] in SHAPE_ATTRIBUTES)
        ):
            args = torch.fx.node.map_arg(n.args, evaluate)
            kwargs = torch.fx.node.map_arg(n.kwargs, evaluate)
            if n.op == "call_method":
                result = getattr(args[0], n.target)(*args[1:], **kwargs)
            else:
                result = n.target(*args, **kwargs)
            if isinstance(result, torch.Tensor):
                raise LookupError("a tensor value")
        else:
            raise LookupError(n.format_node())
        values[n] = result
        return result

    try:
        return True, evaluate(node)
    except (LookupError, TypeError, ValueError, AttributeError):
        return False, None


class _LeafTracer(ThreadBoundTracer):
    """A tracer that records stack traces, keeps given submodules opaque, and notes where it broke.

    A branch on a value computed from input shapes only (``if x.shape[1] != self.channels: raise``) is
    decided from the example inputs, and a ``torch._assert`` guard in the graph makes a call whose shapes
    would take the other branch fail loudly (graphs are specialised to their input shapes anyway).
    """

    def __init__(self, leaves: set[str], inputs: dict[str, Any] | None = None):
        super().__init__()
        self.record_stack_traces = True
        self.leaves = leaves
        self.inputs = inputs or {}

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _ShapeProxy(node, self)

    def _filter_traceback_frames(self, frames: traceback.StackSummary) -> traceback.StackSummary:
        # torch's own filter imports torch.export, Inductor and networkx on first use (about 0.25 s, a tenth
        # of a cold optimize) only to name torch's internal files; these are the same frames, named by folder.
        first = next((i for i, frame in enumerate(frames) if frame.name == "forward"), None)
        if first is None:
            return traceback.StackSummary.from_list([])
        kept = [frame for frame in frames[first:] if not _torch_internal(frame.filename)]
        return traceback.StackSummary.from_list(kept)

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        known, value = shape_value(obj.node, self.inputs)
        if not known:
            return super().to_bool(obj)
        taken = bool(value)
        condition = obj if taken else self.create_proxy("call_function", operator.not_, (obj,), {})
        self.guard(condition, f"`{obj.node.name}` is {taken}")
        return taken

    def to_number(self, obj: torch.fx.Proxy, kind: type) -> Any:
        """``int(x.shape[-1])``: the example's value, guarded like a branch."""
        known, value = shape_value(obj.node, self.inputs)
        if not known or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{kind.__name__}() of a traced value that does not come from input shapes alone")
        self.guard(self.create_proxy("call_function", operator.eq, (obj, value), {}), f"`{obj.node.name}` == {value}")
        return kind(value)

    def guard(self, condition: torch.fx.Proxy, what: str) -> None:
        message = f"fxforge: the graph was traced for inputs where {what}; these inputs differ"
        self.create_proxy("call_function", torch._assert, (condition, message), {})

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # A submodule with hooks stays a module call, so that its hooks fire on every call of the graph.
        return (module_qualified_name in self.leaves or bool(module_qualified_name and has_hooks(m))
                or super().is_leaf_module(m, module_qualified_name))

    def call_module(self, m, forward, args, kwargs):
        try:
            qualname = self.path_of_module(m)
        except NameError:
            qualname = None
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as error:
            # The innermost module whose forward raised is recorded first; outer frames keep it.
            if qualname is not None and not hasattr(error, "_fxforge_module"):
                error._fxforge_module = qualname  # type: ignore[attr-defined]
            raise


_TORCH_DIR = os.path.dirname(torch.__file__)
_TORCH_INTERNAL = tuple(os.path.join(_TORCH_DIR, part) for part in (
    "fx", "_dynamo", "export", "_export", "_subclasses", "_library", "_inductor", "_higher_order_ops", "_logging",
    "__init__.py", "_compile.py"))


def _torch_internal(filename: str) -> bool:
    """Whether a stack frame is in torch's tracing machinery (never the user's code nor a module's forward).

    Example:
        >>> _torch_internal(torch.fx.__file__), _torch_internal(torch.nn.modules.conv.__file__)
        (True, False)
    """
    return filename.startswith(_TORCH_INTERNAL)


class _ShapeProxy(torch.fx.Proxy):
    """A proxy that can become a Python number when it is computed from input shapes (``int(x.shape[2])``)."""

    def __int__(self) -> int:
        return self.tracer.to_number(self, int)

    def __float__(self) -> float:
        return self.tracer.to_number(self, float)


# Python values symbolic tracing can specialise on (torch.fx asserts them at run time, so a call with another
# value fails loudly instead of running the wrong branch).
PYTHON_CONSTANTS = (bool, int, float, str, type(None))


def concrete_args_for(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of ``module.forward`` fixed for tracing: those the caller does not pass (to their
    defaults), and those it passes as plain Python values (``None``, bools, numbers, strings).

    A proxy in place of ``mask=None`` would take the ``if mask is not None`` branch, and one in place of
    ``flag=True`` cannot be branched on at all; fixed, they trace the branch the example takes.

    Example:
        >>> class M(torch.nn.Module):
        ...     def forward(self, x, mask=None, scale=1.0):
        ...         return x
        >>> concrete_args_for(M(), (torch.ones(1),), {"scale": 2.0})
        {'mask': None, 'scale': 2.0}
    """
    signature = inspect.signature(module.forward)
    bound = signature.bind_partial(*args, **kwargs)
    concrete: dict[str, Any] = {}
    for name, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in bound.arguments:
            value = bound.arguments[name]
            if type(value) in PYTHON_CONSTANTS:
                concrete[name] = value
        elif param.default is not inspect.Parameter.empty:
            concrete[name] = param.default
    return concrete


def _restore_placeholder_names(graph: torch.fx.Graph, concrete: dict[str, Any]) -> None:
    """torch.fx names the placeholder of a concrete argument ``name_1``; give it back its own name, so the
    graph module takes the same keyword arguments as the module."""
    if isinstance(graph._codegen, torch.fx.graph._PyTreeCodeGen):
        # A container argument was flattened: the signature already has the original names, and torch.fx
        # would write each placeholder's default into the unpacking line (invalid code), so drop them.
        for node in graph.nodes:
            if node.op == "placeholder":
                node.args = ()
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and isinstance(n.target, str)]
    taken = {n.target for n in placeholders}
    for node in placeholders:
        base, sep, suffix = node.target.rpartition("_")
        if sep and suffix.isdigit() and base in concrete and base not in taken:
            node.target = base
            taken.add(base)


class OutputTypeCodeGen(torch.fx.graph.CodeGen):
    """Code generation that returns the graph's output dict as an instance of the module's own dict type.

    Symbolic tracing records a returned ``dict`` subclass (a transformers ``ModelOutput``) as a plain dict,
    so the graph would return ``{"logits": ...}`` where the model returns ``ModelOutput(logits=...)``.
    This codegen rebuilds the type with keyword arguments, in the generated code and in
    ``torch.fx.Interpreter`` runs alike.

    Example:
        >>> import collections
        >>> gm = torch.fx.symbolic_trace(lambda x: {"y": x})
        >>> restore_output_type(gm, collections.OrderedDict)
        True
        >>> type(gm(torch.ones(1))).__name__
        'OrderedDict'
    """

    def __init__(self, output_type: type):
        super().__init__()
        self.output_type = output_type
        self.global_name = f"_fxforge_output_type_{output_type.__name__}"

    def additional_globals(self) -> list[tuple[str, Any]]:
        return [(self.global_name, self.output_type)]

    def generate_output(self, output_args: Any, *, descs: Any = None, repr_fn: Any = None) -> str:
        repr_fn = repr_fn or repr
        fields = ", ".join(f"{key}={repr_fn(value)}" for key, value in output_args.items())
        return f"return {self.global_name}({fields})"

    def process_outputs(self, outputs: Any) -> Any:
        return self.output_type(**outputs)


def restore_output_type(graph_module: torch.fx.GraphModule, output_type: type) -> bool:
    """Make ``graph_module`` return its output dict as ``output_type`` (a ``dict`` subclass taking its
    keys as keyword arguments, such as a transformers ``ModelOutput``); see :class:`OutputTypeCodeGen`.

    Returns False, changing nothing, when the graph does not return a plain dict with identifier keys
    or already has its own code generation (a flattened container input).
    """
    graph = graph_module.graph
    output = graph.output_node()
    value = output.args[0] if output.args else None
    if type(graph._codegen) is not torch.fx.graph.CodeGen or not isinstance(value, dict):
        return False
    if not all(isinstance(key, str) and key.isidentifier() for key in value):
        return False
    graph._codegen = OutputTypeCodeGen(output_type)
    graph_module.recompile()
    return True


def trace_with_leaves(module: nn.Module, args: tuple, kwargs: dict, max_leaves: int = 64) -> TraceResult:
    """Symbolically trace ``module``, keeping opaque each submodule in which tracing breaks.

    Raises:
        TraceFailure: tracing broke in the root module's forward (or in more than ``max_leaves``
            submodules); it names the reason and the user's line.

    Example:
        >>> r = trace_with_leaves(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {})
        >>> r.graph_module(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    if kwargs:
        # Keyword inputs become ordinary placeholders; symbolic_trace only knows positional order.
        signature = inspect.signature(module.forward)
        bound = signature.bind(*args, **kwargs)
        if any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values() if p.name in bound.arguments):
            raise TraceFailure("**kwargs inputs cannot be traced symbolically", None)
    concrete = concrete_args_for(module, args, kwargs)
    example_inputs = dict(inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments)
    leaves: set[str] = set()
    opaque: list[OpaqueModule] = []
    modules = dict(module.named_modules())
    while True:
        tracer = _LeafTracer(leaves, example_inputs)
        try:
            with tracing():
                graph = tracer.trace(module, concrete_args=concrete or None)
        except Exception as error:
            reason, source = first_line(error), user_frame_of(error)
            name = getattr(error, "_fxforge_module", None)
            if not name or name in leaves or len(leaves) >= max_leaves:
                raise TraceFailure(reason, source, opaque) from error
            leaves.add(name)
            opaque.append(OpaqueModule(name, type(modules[name]).__name__, reason, source))
            continue
        _restore_placeholder_names(graph, concrete)
        graph_module = tracer.graph_module(graph, module.__class__.__name__)
        # A leaf whose parent later became a leaf too is inside the parent: report the outermost only.
        outermost = [o for o in opaque if not any(o.name.startswith(p + ".") for p in leaves)]
        return TraceResult(graph_module, outermost)


# torch.nn modules that a symbolic trace keeps whole (torch.fx's default leaves) although they hold linear
# layers and attention that fxforge's rewrites and kernel choices would otherwise see: the attention and
# transformer layers. (A Linear, a Conv2d, a norm or an activation left whole is a single op the rewrites
# already match.)
WORK_HIDING_LEAVES: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
    nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
# Where a graph's functions come from when they are torch's or Python's own ops, not a library's function
# that ``torch.fx.wrap`` keeps whole (torchvision's ``shifted_window_attention``, say).
_OP_MODULES = ("torch", "_operator", "operator", "builtins", "math", "fxforge", "_functools")


def _takes_a_weight(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` is handed a parameter of two or more dims (a weight matrix, a kernel) directly."""
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            try:
                value = graph_module.get_parameter(arg.target)
            except AttributeError:
                continue
            if value.dim() >= 2:
                return True
    return False


def hidden_work(graph_module: torch.fx.GraphModule) -> list[str]:
    """What a symbolic trace kept whole that holds work the rewrites cannot see into, as report lines
    (``"2 MultiheadAttention modules (layers.0.attn, ...)"``): the attention and transformer layers of
    :data:`WORK_HIDING_LEAVES`, and library functions that ``torch.fx.wrap`` kept whole and that are handed a
    weight (torchvision's ``shifted_window_attention``; not its ``stochastic_depth``, the identity in eval
    mode). A layer with hooks is not listed: it is a module call so that its hooks fire. Empty when there are
    none.

    Example:
        >>> layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        >>> hidden_work(torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), layer)))
        ['1 TransformerEncoderLayer module (1)']
    """
    found: dict[str, list[str]] = {}
    for node in graph_module.graph.nodes:
        if node.op == "call_module":
            module = graph_module.get_submodule(node.target)
            if isinstance(module, WORK_HIDING_LEAVES) and not has_hooks(module):  # a hooked one stays whole
                found.setdefault(f"{type(module).__name__} module", []).append(node.target)
        elif node.op == "call_function":
            origin = getattr(node.target, "__module__", None) or ""
            if origin and origin.split(".")[0] not in _OP_MODULES and _takes_a_weight(graph_module, node):
                found.setdefault(f"{origin}.{getattr(node.target, '__name__', node.target)} call", []).append(node.name)
    lines = []
    for what, where in found.items():
        kind = what if len(where) == 1 else what + "s"
        shown = ", ".join(where[:3]) + (", ..." if len(where) > 3 else "")
        lines.append(f"{len(where)} {kind} ({shown})")
    return lines
