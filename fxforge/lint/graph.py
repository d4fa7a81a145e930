"""``LintGraph``: what a lint rule reads. The captured graph's call nodes by op name (the same name for the
ATen op of a torch.export graph and the function or method of a symbolic trace: ``softmax``, ``mul_``,
``dropout``), each node's tensor (shape, dtype, strides, bytes), its user's source line, and the model.

Example:
    >>> import fxforge
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Softmax(dim=-1)).eval()
    >>> graph = LintGraph.of(fxforge.capture(model, (torch.ones(3, 4),), method="export", check=False), model)
    >>> [graph.op(n) for n in graph.calls()]
    ['linear', 'softmax']
    >>> graph.describe(graph.calls("softmax")[0])
    '[3, 2] float32'
"""

from __future__ import annotations

import dataclasses
import linecache
import operator
import os
import re
from typing import Any

import torch

from fxforge.core.source import node_source
from fxforge.core.units import format_bytes
from fxforge.lint.finding import Finding
from fxforge.lint.modules import as_op

_AUGMENTED = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_AUGMENTED_RE = re.compile(r"^[\w.\[\]]+\s*(?P<op>[-+*/])=[^=]")
SHAPE_READS = {"size", "sym_size", "dim", "numel", "sym_numel", "getattr", "sym_stride", "stride"}
"""Ops that read a tensor's size, not its values."""
_SOURCE_RE = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?:: (?P<code>.*))?$")
# Python operators as a symbolic trace records them -> the ATen op name.
_OPERATORS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
              operator.floordiv: "floor_divide", operator.pow: "pow", operator.iadd: "add_", operator.isub: "sub_",
              operator.imul: "mul_", operator.itruediv: "div_", operator.getitem: "getitem",
              operator.matmul: "matmul", operator.gt: "gt", operator.lt: "lt", operator.eq: "eq"}


@dataclasses.dataclass
class LintGraph:
    """A captured graph as the rules read it.

    Attributes:
        graph_module: the captured ``GraphModule`` (torch.export's ATen graph, or a symbolic trace); None where no
            single graph holds the model.
        model: the user's model (in the mode it was captured in).
        method: how it was captured: ``"export"``, ``"fx"`` (a symbolic trace) or ``"dynamo"`` (``graphs``).
        inputs: the example inputs' tensors, flattened.
        breaks: where TorchDynamo cuts the model (:class:`~fxforge.core.breaks.Break`), where it was asked.
        opaque: the submodules a symbolic trace kept whole (their insides are not linted).
        graphs: where TorchDynamo cuts the model, the graphs between its breaks (``method`` is ``"dynamo"``); the
            rules read their nodes as one graph's.
    """

    graph_module: torch.fx.GraphModule | None
    model: torch.nn.Module
    method: str = ""
    inputs: tuple = ()
    breaks: list = dataclasses.field(default_factory=list)
    opaque: list = dataclasses.field(default_factory=list)
    graphs: list = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, captured: Any, model: torch.nn.Module, breaks: list | None = None) -> LintGraph:
        """The lint view of a :class:`~fxforge.core.captured.Captured`."""
        tensors = [t for t in torch.utils._pytree.tree_leaves((captured.example_args, captured.example_kwargs))
                   if isinstance(t, torch.Tensor)]
        return cls(captured.graph_module, model, captured.method, tuple(tensors), list(breaks or []),
                   list(captured.opaque))

    # -- nodes -------------------------------------------------------------------------------------------------
    def nodes(self) -> list[torch.fx.Node]:
        """Every node of the graph (of each graph between breaks, in turn), in order ([] without a graph)."""
        modules = [self.graph_module] if self.graph_module is not None else self.graphs
        return [node for module in modules for node in module.graph.nodes]

    def owner(self, node: torch.fx.Node) -> torch.fx.GraphModule:
        """The ``GraphModule`` the node belongs to."""
        return node.graph.owning_module

    def calls(self, *names: str) -> list[torch.fx.Node]:
        """The nodes that compute, in order; with ``names``, those whose :meth:`op` is one of them."""
        calls = [n for n in self.nodes() if n.op in ("call_function", "call_method", "call_module")]
        return [n for n in calls if self.op(n) in names] if names else calls

    def op(self, node: torch.fx.Node) -> str:
        """The op's name: ``softmax`` for ``aten.softmax.int``, ``torch.softmax``, ``F.softmax`` and
        ``x.softmax``; ``mul_`` for ``aten.mul_.Tensor`` and ``x *= y`` in a trace; ``dropout`` for a call of an
        ``nn.Dropout`` (:func:`~fxforge.lint.modules.as_op`), another module call's class name.
        """
        target = node.target
        if node.op == "call_module":
            module = self.owner(node).get_submodule(str(target))
            read = as_op(module, node.args[0] if node.args else None)
            return read[0] if read is not None else type(module).__name__
        if node.op == "call_method":
            return str(target)
        if isinstance(target, torch._ops.OpOverload):
            return target._opname
        if target in _OPERATORS:
            name = _OPERATORS[target]
            if name in _AUGMENTED and node.op == "call_function" and self.method != "export":
                # A trace records ``x *= y`` as ``x * y``; the line says it ran in place.
                match = _AUGMENTED_RE.match(self.source(node)[2])
                if match and match["op"] == _AUGMENTED[name]:
                    return name + "_"
            return name
        return getattr(target, "__name__", str(target))

    def arg(self, node: torch.fx.Node, index: int, *names: str, default: Any = None) -> Any:
        """The node's argument at position ``index`` or given by one of ``names``, else ``default`` (a module
        call's as the ATen op it runs takes them)."""
        if node.op == "call_module":
            read = as_op(self.owner(node).get_submodule(str(node.target)), node.args[0] if node.args else None)
            if read is not None:
                return read[1][index] if index < len(read[1]) else default
        if index < len(node.args):
            return node.args[index]
        for name in names:
            if name in node.kwargs:
                return node.kwargs[name]
        return default

    def tensor_args(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The node's arguments that are nodes holding a tensor, in order."""
        found = []
        torch.fx.map_arg((node.args, node.kwargs), lambda n: found.append(n) if self.value(n) is not None else None)
        return found

    # -- tensors -----------------------------------------------------------------------------------------------
    def value(self, node: Any) -> torch.Tensor | None:
        """The (fake) tensor a node computes, where the capture recorded one."""
        if not isinstance(node, torch.fx.Node):
            return None
        value = node.meta.get("val")
        return value if isinstance(value, torch.Tensor) else None

    def shape(self, node: Any) -> tuple[int, ...] | None:
        value = self.value(node)
        return tuple(int(s) for s in value.shape) if value is not None else None

    def nbytes(self, node: Any) -> int:
        """Bytes of the node's tensor (0 where it has none)."""
        value = self.value(node)
        return int(value.numel()) * value.element_size() if value is not None else 0

    def describe(self, node: Any) -> str:
        """``[4, 8] float32`` (with the size where it is 1 KiB or more)."""
        value = self.value(node)
        if value is None:
            return repr(node)
        size = self.nbytes(node)
        text = f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        return text + (f" ({format_bytes(size)})" if size >= 1024 else "")

    def depends_on_inputs(self) -> set[torch.fx.Node]:
        """The nodes whose value depends on the example inputs' values (the placeholders): a trace's reads of their
        sizes (``x.shape``, ``x.size(1)``) do not count, as they are constants in an export."""
        found: set[torch.fx.Node] = set()
        for node in self.nodes():
            if node.op == "placeholder" or (self.op(node) not in SHAPE_READS
                                            and any(a in found for a in node.all_input_nodes)):
                found.add(node)
        return found

    # -- source ------------------------------------------------------------------------------------------------
    def source(self, node: torch.fx.Node) -> tuple[str, int, str]:
        """(file, line, code) of the user's line that made the node; ('', 0, '') where none was recorded."""
        return parse_source(node_source(node))

    def finding(self, node: torch.fx.Node | None, message: str, fix: str, *, severity: str = "",
                involved: str = "", bytes: int | None = None, where: tuple[str, int, str] | None = None) -> Finding:
        """A finding at the node's source line (or at ``where``); the rule fills in its name and severity."""
        file, line, code = where if where is not None else self.source(node) if node is not None else ("", 0, "")
        return Finding("", severity, file, line, code, message, fix, involved, bytes)


def parse_source(text: str | None) -> tuple[str, int, str]:
    """``file.py:12: code`` -> ``("file.py", 12, "code")``.

    Example:
        >>> parse_source("net.py:12: y = x + 1"), parse_source(None)
        (('net.py', 12, 'y = x + 1'), ('', 0, ''))
    """
    match = _SOURCE_RE.match(text or "")
    if match is None:
        return "", 0, ""
    return match["file"], int(match["line"]), (match["code"] or "").strip()


def source_line(file: str, line: int) -> str:
    """The text of ``file``'s line ``line`` as Python's ``linecache`` has it ('' where unknown).

    Example:
        >>> source_line("/no/such/file.py", 3)
        ''
    """
    if not file or line <= 0:
        return ""
    return linecache.getline(file if os.path.isabs(file) else os.path.abspath(file), line) or linecache.getline(file, line)


def short_path(file: str) -> str:
    """``file`` relative to the current directory where it is below it (as the graph's source lines are).

    Example:
        >>> short_path(os.path.join(os.getcwd(), "net.py"))
        'net.py'
    """
    try:
        relative = os.path.relpath(file)
    except ValueError:
        return file
    return file if relative.startswith("..") else relative
