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
from typing import Any

import torch
from torch import nn

from fxforge.capture.source import first_line, user_frame_of


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


class _LeafTracer(torch.fx.Tracer):
    """A tracer that records stack traces, keeps given submodules opaque, and notes where it broke."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.record_stack_traces = True
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)

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
    leaves: set[str] = set()
    opaque: list[OpaqueModule] = []
    modules = dict(module.named_modules())
    while True:
        tracer = _LeafTracer(leaves)
        try:
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
        graph_module = torch.fx.GraphModule(tracer.root, graph, module.__class__.__name__)
        # A leaf whose parent later became a leaf too is inside the parent: report the outermost only.
        outermost = [o for o in opaque if not any(o.name.startswith(p + ".") for p in leaves)]
        return TraceResult(graph_module, outermost)
