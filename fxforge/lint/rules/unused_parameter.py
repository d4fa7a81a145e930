"""``unused-parameter``: trainable parameters the forward never reads. ``DistributedDataParallel`` with its
default ``find_unused_parameters=False`` then fails (it waits for their gradients), the optimizer keeps state
for them, and they are usually a layer that was meant to be called. Reported at the line of ``__init__`` that
made them.

Example:
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.body = torch.nn.Linear(8, 8)
    ...         self.head = torch.nn.Linear(8, 2)
    ...     def forward(self, x):
    ...         return self.body(x)
    >>> [f.message.split(" has")[0] for f in fxforge.lint(Net(), (torch.randn(4, 8),), rules=[RULE])]
    ["module 'head'"]
"""

from __future__ import annotations

import inspect
import re

import torch

from fxforge.lint.graph import LintGraph, format_bytes, short_path
from fxforge.lint.rule import Rule


def _read_names(graph: LintGraph) -> set[str]:
    """Names of the parameters (and prefixes of whole modules) the graph reads."""
    names = set()
    for node in graph.nodes():
        if node.op == "get_attr" and node.users:
            names.add(str(node.target))
        elif node.op == "call_module":
            names.add(str(node.target) + ".")
    names |= {getattr(o, "name", str(o)) + "." for o in graph.opaque}
    return names


def _held(graph: LintGraph) -> set[int]:
    """The tensors the graphs between breaks hold (TorchDynamo passes a graph the parameters it reads)."""
    return {id(t) for module in graph.graphs for t in (*module.parameters(), *module.buffers())}


def _is_read(name: str, read: set[str]) -> bool:
    return name in read or any(name.startswith(prefix) for prefix in read if prefix.endswith("."))


def defined_at(model: torch.nn.Module, path: str) -> tuple[str, int, str]:
    """(file, line, code) of the ``self.name = ...`` in ``__init__`` that made the attribute at ``path`` (a
    parameter's or module's dotted name), the nearest enclosing one that a class's source names.

    Example:
        >>> defined_at(torch.nn.Linear(2, 2), "weight")[2]
        'self.weight = Parameter('
    """
    while path:
        parent_path, _, attr = path.rpartition(".")
        try:
            parent = model.get_submodule(parent_path)
        except AttributeError:
            return "", 0, ""
        if parent_path and is_library(type(parent)):
            path = parent_path
            continue  # the user's line, not torch's (self.weight = Parameter(...) in nn.Linear)
        pattern = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=]*)?=[^=]")
        for cls in type(parent).__mro__:
            try:
                lines, start = inspect.getsourcelines(cls)
                file = inspect.getsourcefile(cls) or ""
            except (OSError, TypeError):
                continue
            for offset, text in enumerate(lines):
                if pattern.search(text):
                    return short_path(file), start + offset, text.strip()
        path = parent_path
    return "", 0, ""


def is_library(cls: type) -> bool:
    """Whether a class is torch's own (its source is not the user's).

    Example:
        >>> is_library(torch.nn.Linear)
        True
    """
    return cls.__module__.split(".")[0] == "torch"


def _uses_training_flag(model: torch.nn.Module) -> bool:
    for module in model.modules():
        if is_library(type(module)):
            continue  # torch's own (BatchNorm reads self.training): the user's branches are the question
        try:
            if "self.training" in inspect.getsource(type(module).forward):
                return True
        except (OSError, TypeError):
            continue
    return False


def check(graph: LintGraph):
    read, held = _read_names(graph), _held(graph)
    groups: dict[int, list[str]] = {}
    for name, parameter in graph.model.named_parameters(remove_duplicate=False):
        if parameter.requires_grad:
            groups.setdefault(id(parameter), []).append(name)
    unused: dict[str, list[str]] = {}  # owning module -> parameter names
    for key, names in groups.items():
        if key not in held and not any(_is_read(n, read) for n in names):
            unused.setdefault(names[0].rpartition(".")[0], []).append(names[0])
    flag = _uses_training_flag(graph.model) if unused else False
    # Between graph breaks, only the path these inputs took was traced: another may read them.
    untaken = graph.method == "dynamo"
    for owner, names in unused.items():
        count = sum(graph.model.get_parameter(n).numel() for n in names)
        size = sum(graph.model.get_parameter(n).numel() * graph.model.get_parameter(n).element_size() for n in names)
        what = f"module {owner!r}" if owner else "the model's own parameter"
        yield graph.finding(
            None, f"{what} has trainable parameters the forward never reads ({', '.join(names)}: {count:,} values): "
                  "DistributedDataParallel's default (find_unused_parameters=False) fails on them, the optimizer "
                  "keeps state for them; a layer meant to be called?"
                  + (" (the model branches on self.training: they may be read only in training mode)" if flag else "")
                  + (" (linted graph by graph between breaks: a path these inputs did not take may read them)"
                     if untaken else ""),
            "call the layer in forward, delete it, or freeze it (requires_grad_(False)); with DDP, "
            "find_unused_parameters=True only as a last resort (it costs a graph walk every step)",
            severity="info" if flag or untaken else "", involved=f"{count:,} parameters ({format_bytes(size)})", bytes=size,
            where=defined_at(graph.model, names[0]))


RULE = Rule("unused-parameter", "warning", check,
            "trainable parameters the forward never reads: DDP's default fails, the optimizer keeps their state")
