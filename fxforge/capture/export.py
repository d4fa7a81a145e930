"""Capture with ``torch.export`` (non-strict) and turn the program back into a callable GraphModule.

The GraphModule keeps the module's calling convention (same positional and keyword inputs, same output
structure, pytrees such as transformers' ``ModelOutput`` included), shares the module's parameters and
buffers, and applies buffer mutations (BatchNorm running statistics in training mode) as eager does.

Example:
    >>> import torch
    >>> gm = export_graph_module(torch.nn.Linear(2, 3), (torch.ones(1, 2),), {})
    >>> gm(torch.ones(1, 2)).shape
    torch.Size([1, 3])
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.capture.fx_trace import PYTHON_CONSTANTS
from fxforge.core.module_snapshot import left_as_found
from fxforge.core.tracing import tracing
from fxforge.core.vocabulary import has_hooks

# Loggers that narrate a failed export at WARNING level; the failure itself is reported by fxforge.
_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export")


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """Silence what torch.export prints to stderr while it fails (partial graphs, guard warnings).

    Example:
        >>> with quiet_export():
        ...     pass
    """
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_graph_module(module: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None
                        ) -> torch.fx.GraphModule:
    """``torch.export.export(module, args, kwargs, strict=False).module()``, without the per-call checks.

    The exported module checks its inputs against the exported shapes on every call (hooks, and in newer
    torch a ``_guards_fn`` submodule called from the graph); fxforge keys its graphs by input signature
    instead, so those are dropped. Python-value inputs (``None``, bools, numbers, strings), which
    torch.export bakes into the graph, are asserted instead, as a symbolic trace does. Parameters and
    buffers are the module's own objects. ``dynamic_shapes`` goes to ``torch.export.export`` as it is. The
    module is left as it was (:func:`~fxforge.core.module_snapshot.left_as_found`).

    A module with forward or backward hooks is refused: torch.export runs a hook once, while tracing, and
    bakes what it computed into the graph (its side effects, like collecting features, are lost).

    Raises:
        ValueError: the module or a submodule has hooks.
        Exception: whatever ``torch.export`` raises; the caller turns it into a capture reason.

    Example:
        >>> gm = export_graph_module(torch.nn.ReLU(), (torch.ones(2),), {})
        >>> gm(-torch.ones(2)).tolist()
        [0.0, 0.0]
    """
    hooked = [name or "the model" for name, m in module.named_modules() if has_hooks(m)]
    if hooked:
        raise ValueError(f"{', '.join(hooked[:3])} {'has' if len(hooked) == 1 else 'have'} hooks, which "
                         "torch.export would run once while tracing instead of on every call")
    # What the forward writes on its modules while torch.export runs it on fake tensors (a cache entry) is
    # taken off again: the model is left as it was, whether the export succeeds or fails.
    with tracing(), quiet_export(), left_as_found(module):
        program = torch.export.export(module, tuple(args), dict(kwargs), dynamic_shapes=dynamic_shapes,
                                      strict=False)
    unlifted = _unlift(program)
    graph_module = torch.fx.GraphModule(unlifted, unlifted.graph, module.__class__.__name__)
    graph_module.meta["fxforge_ranges"] = dict(program.range_constraints)  # the dynamic dims' ranges
    _drop_guards(graph_module)
    _assert_constants(graph_module, args, kwargs)
    _share_state(graph_module, module)
    return graph_module


def _unlift(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """``program.module()`` without the guard-checking node where this torch can leave it out."""
    if "check_guards" in inspect.signature(program.module).parameters:
        return program.module(check_guards=False)
    return program.module()


def _drop_guards(graph_module: torch.fx.GraphModule) -> None:
    """Remove a ``_guards_fn`` call (input-shape guards, no outputs) that newer torch puts in the graph.

    The graph is specialised to the example shapes either way; callers key graphs by input signature.
    """
    guards = [n for n in graph_module.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]
    if any(node.users for node in guards):
        return
    for node in guards:
        graph_module.graph.erase_node(node)
    if guards:
        graph_module.delete_submodule("_guards_fn")
        graph_module.graph.lint()
        graph_module.recompile()


def _assert_constants(graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Make the graph refuse Python-value inputs (``None``, bools, numbers, strings) other than the ones it
    was exported with, as a symbolic trace does: torch.export bakes them in and would silently ignore a
    different value.
    """
    in_spec = getattr(graph_module, "_in_spec", None)
    if in_spec is None:
        return
    leaves, spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    placeholders = list(graph_module.graph.find_nodes(op="placeholder"))
    if spec != in_spec or len(leaves) != len(placeholders):
        return
    last = placeholders[-1] if placeholders else None
    added = False
    for (_, value), node in zip(leaves, placeholders):
        if type(value) not in PYTHON_CONSTANTS:
            continue
        message = f"{node.target} has been specialized to have value {value!r} but got another value"
        with graph_module.graph.inserting_after(last):
            if value is None:
                check = graph_module.graph.call_function(operator.is_, (node, None))
            else:
                check = graph_module.graph.call_function(operator.eq, (node, value))
        with graph_module.graph.inserting_after(check):
            last = graph_module.graph.call_function(torch._assert, (check, message))
        check.meta["val"], last.meta["val"] = True, None
        added = True
    if added:
        graph_module.graph.lint()
        graph_module.recompile()


def _share_state(graph_module: torch.fx.GraphModule, module: nn.Module) -> None:
    """Point the graph's parameters and buffers at the module's own tensors, by qualified name."""
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(dict(module.named_buffers(remove_duplicate=False)))
    for name, tensor in list(graph_module.named_parameters(remove_duplicate=False)) + list(
        graph_module.named_buffers(remove_duplicate=False)
    ):
        original = own.get(name)
        if original is None or original is tensor:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = graph_module.get_submodule(owner_name) if owner_name else graph_module
        if isinstance(original, nn.Parameter):
            owner._parameters[attr] = original
        else:
            owner._buffers[attr] = original
