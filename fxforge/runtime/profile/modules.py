"""Which of the user's modules each node of a graph belongs to (``module`` in a profile's table).

Example:
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> module_paths(gm)
    {'_0': '0', '_1': '1'}
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from fxforge.core.nodes import CALL_OPS
from fxforge.core.source import node_source


def _stack_paths(node: torch.fx.Node) -> list[tuple[str, Any]]:
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for key, value in stack.items():
        path, kind = (value[0], value[1]) if isinstance(value, tuple) and len(value) >= 2 else (key, None)
        path = re.sub(r"^L\['self'\]\.?", "", str(path))
        paths.append((path, kind))
    return paths


def _own_module(node: torch.fx.Node) -> str | None:
    """The module a node belongs to according to its own metadata, or None when it has none."""
    if node.op == "call_module":
        return str(node.target)
    paths = _stack_paths(node)
    return paths[-1][0] if paths else None


def _enclosing(node: torch.fx.Node) -> str | None:
    """The module whose ``forward`` holds the node's source line (a torch.nn layer's line is in its parent)."""
    paths = _stack_paths(node)
    if node.op == "call_module":
        path = str(node.target)
        return path.rsplit(".", 1)[0] if "." in path else ""
    if not paths:
        return None
    kind = paths[-1][1]
    module_name = kind.__module__ if isinstance(kind, type) else str(kind or "")
    if module_name.startswith("torch.nn") and len(paths) > 1:
        return paths[-2][0]
    return paths[-1][0]


def module_paths(graph_module: torch.fx.GraphModule, model: nn.Module | None = None) -> dict[str, str]:
    """The user's module path of each computing node (``""`` where none is known).

    A ``call_module`` node's target is its path; other nodes use ``meta["nn_module_stack"]`` (fx traces and
    torch.export both record it). Nodes a rewrite created carry no stack; for them, in this order:

    1. a parameter they read by its path (``fc.weight`` -> ``fc``: a fused linear layer);
    2. the module whose ``forward`` holds their source line, read from a nearby node (up to three edges
       away) with the same source line and a stack (a folded conv+BN next to its block's ReLU);
    3. with ``model`` given: the one submodule of ``model`` whose class's ``forward`` holds their source line
       (several instances of that class, and no nearby node telling which: unknown).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
        >>> module_paths(gm)
        {'_0': '0', '_1': '1'}
    """
    result: dict[str, str] = {}
    lines: _SourceIndex | None = None
    for node in graph_module.graph.nodes:
        if node.op not in CALL_OPS:
            continue
        own = _own_module(node)
        if own is None:
            own = _parameter_owner(node)
        if own is None:
            own = _nearby_enclosing(node)
        if own is None and model is not None:
            lines = lines or _SourceIndex(model)
            own = lines.module_of(node)
        result[node.name] = own or ""
    return result


def _parameter_owner(node: torch.fx.Node) -> str | None:
    for arg in node.all_input_nodes:
        target = str(arg.target) if arg.op == "get_attr" else ""
        if "." in target and not target.startswith("_fxforge"):
            return target.rsplit(".", 1)[0]
    return None


class _SourceIndex:
    """Which submodules of a model run a given source line in their class's ``forward``."""

    def __init__(self, model: nn.Module):
        import inspect
        import os

        self.spans: list[tuple[str, str, int, int]] = []  # (path, file, first line, last line)
        spans: dict[type, tuple[str, int, int] | None] = {}
        for path, module in model.named_modules():
            cls = type(module)
            if cls not in spans:
                try:
                    forward = inspect.unwrap(cls.forward)
                    code_lines, first = inspect.getsourcelines(forward)
                    spans[cls] = (os.path.abspath(inspect.getsourcefile(forward) or ""), first,
                                  first + len(code_lines) - 1)
                except (OSError, TypeError):
                    spans[cls] = None
            if spans[cls] is not None:
                self.spans.append((path, *spans[cls]))

    def module_of(self, node: torch.fx.Node) -> str | None:
        import os

        match = re.match(r"(?P<file>.+?):(?P<line>\d+)(?::|$)", node_source(node) or "")
        if not match:
            return None
        file, line = os.path.abspath(match["file"]), int(match["line"])
        found = [path for path, f, first, last in self.spans if f == file and first <= line <= last]
        return found[0] if len(found) == 1 else None


def _nearby_enclosing(node: torch.fx.Node, hops: int = 3) -> str | None:
    source = node_source(node)
    if not source:
        return None
    seen = {node}
    frontier = [node]
    for _ in range(hops):
        nxt = []
        for current in frontier:
            for other in [*current.all_input_nodes, *current.users]:
                if other in seen or other.op not in CALL_OPS:
                    continue
                seen.add(other)
                nxt.append(other)
        for other in nxt:
            if node_source(other) == source:
                found = _enclosing(other)
                if found is not None:
                    return found
        frontier = nxt
    return None
