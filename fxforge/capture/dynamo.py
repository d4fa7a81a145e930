"""Capture through TorchDynamo: the graphs between a model's graph breaks, each as a module fxforge can rewrite.

TorchDynamo cuts a forward at what one graph cannot hold (a branch on a tensor's value, ``.item()``, ``print``, a
``torch.compiler.disable``d helper) and hands each graph to a backend. fxforge's backend (:data:`BACKEND`, one for
the process, so that dynamo's compiled code is shared by every instance of a class instead of recompiled per
instance) returns a :class:`CompiledGraph`, which asks the *owner* on top of this thread's stack (the optimized
module whose call is running, see :func:`owning`) to run it; with no owner it runs dynamo's graph as it is.

A dynamo graph takes the model's parameters and buffers as inputs. :func:`host_module` turns it into a
``GraphModule`` that holds them as attributes (the model's own tensors: live weights, folds and fusions see
them), reads sizes off its tensor inputs instead of taking them as ints, and takes the other inputs as they are.

Example:
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(3, 3)
    ...     def forward(self, x):
    ...         y = self.fc(x)
    ...         if y.sum() > 0:
    ...             y = y * 2
    ...         return y - 1
    >>> found = capture_dynamo(Net(), (torch.ones(2, 3),))
    >>> len(found.graphs), found.breaks[0].reason
    (2, "branches on a tensor's value, which one graph cannot hold")
"""

from __future__ import annotations

import dataclasses
import linecache
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxforge.capture.inputs import normalize_inputs
from fxforge.core.breaks import Break, distinct, explain_break
from fxforge.core.source import format_location

# dynamo's source of a model's tensor: L['self']._modules['conv']._parameters['weight'] (or ._buffers[...]).
_PATH_PART = re.compile(r"\._(modules|parameters|buffers)\['([^']+)'\]")
_OWNERS = threading.local()
# What a host keeps of the meta dynamo recorded on its nodes: where each came from in the user's code.
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


@dataclasses.dataclass(frozen=True)
class GraphLayout:
    """Which of a dynamo graph's inputs are what.

    Attributes:
        bound: positions of inputs that are the model's parameters and buffers (held as attributes).
        names: their attribute names in the host (dotted, as in the model where dynamo's source says so).
        sizes: position of an int input -> ``(position of a tensor input, dim)`` whose size it is.
        kept: positions of the inputs the host takes.
        dynamic: ``(leaf, dim)`` of the host's inputs whose sizes dynamo made symbolic (automatic dynamic shapes:
            the graph was compiled again for a new size), leaf counting the kept inputs.
    """

    bound: tuple[int, ...]
    names: tuple[str, ...]
    sizes: dict[int, tuple[int, int]]
    kept: tuple[int, ...]
    dynamic: frozenset = frozenset()


def attribute_path(source: str) -> str | None:
    """The dotted attribute path of a model's tensor from dynamo's source name, or None for another source.

    Example:
        >>> attribute_path("L['self']._modules['layers']._modules['0']._parameters['weight']")
        'layers.0.weight'
        >>> attribute_path("L['x']") is None
        True
    """
    parts = _PATH_PART.findall(source)
    if not parts or parts[-1][0] == "modules":
        return None
    return ".".join(name for _, name in parts)


def layout_of(gm: torch.fx.GraphModule, example_inputs: list) -> GraphLayout:
    """The :class:`GraphLayout` of a graph dynamo handed over with ``example_inputs``.

    Example:
        >>> layout_of(torch.fx.symbolic_trace(torch.nn.ReLU()), [torch.ones(1)]).kept
        (0,)
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    bound, names, sizes, kept = [], [], {}, []
    symbols: dict[str, tuple[int, int]] = {}
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    symbols.setdefault(str(size), (i, dim))
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        grapharg = node.meta.get("grapharg")
        source = grapharg.source.name if grapharg is not None and getattr(grapharg, "source", None) is not None else ""
        path = attribute_path(source) if isinstance(value, torch.Tensor) else None
        example = node.meta.get("example_value")
        if path is not None and path not in names:
            bound.append(i)
            names.append(path)
        elif isinstance(example, torch.SymInt) and str(example) in symbols:
            sizes[i] = symbols[str(example)]
        else:
            kept.append(i)
    dynamic = frozenset((leaf, dim) for leaf, i in enumerate(kept)
                        if isinstance(value := placeholders[i].meta.get("example_value"), torch.Tensor)
                        for dim, size in enumerate(value.shape) if isinstance(size, torch.SymInt))
    return GraphLayout(tuple(bound), tuple(names), sizes, tuple(kept), dynamic)


def host_module(gm: torch.fx.GraphModule, layout: GraphLayout, tensors: list[torch.Tensor],
                training: bool) -> torch.fx.GraphModule:
    """``gm`` as a ``GraphModule`` holding ``tensors`` (the bound inputs' values, the model's own) as parameters
    and buffers under ``layout.names``, reading its size inputs off its tensors, and taking ``layout.kept``.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> host_module(gm, layout_of(gm, [torch.ones(1)]), [], False)(-torch.ones(2)).tolist()
        [0.0, 0.0]
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    root = nn.Module()
    for name, tensor in zip(layout.names, tensors):
        owner_path, _, leaf = name.rpartition(".")
        owner = root
        for part in owner_path.split(".") if owner_path else ():
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if isinstance(tensor, nn.Parameter):
            owner.register_parameter(leaf, tensor)
        else:
            owner.register_buffer(leaf, tensor)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i in layout.kept:
        env[placeholders[i]] = graph.node_copy(placeholders[i])
    for i, name in zip(layout.bound, layout.names):
        env[placeholders[i]] = graph.get_attr(name)
    for i, (tensor_at, dim) in layout.sizes.items():
        env[placeholders[i]] = graph.call_method("size", (env[placeholders[tensor_at]], dim))
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    for old, new in env.items():
        new.meta = {key: old.meta[key] for key in _KEPT_META if key in old.meta}
    host = torch.fx.GraphModule(root, graph, class_name="DynamoGraph")
    host.fxforge_dynamo_graph = True
    host.train(training)
    return host


def own_graph(module: nn.Module) -> Any:
    """A host module's graph as a symbolic trace's result (a copy, with the user's source lines dynamo recorded),
    or None for any other module (which is traced).

    Example:
        >>> own_graph(torch.nn.ReLU()) is None
        True
    """
    if not getattr(module, "fxforge_dynamo_graph", False):
        return None
    from fxforge.capture.fx_trace import TraceResult

    graph = torch.fx.Graph()
    output = graph.graph_copy(module.graph, {})
    graph.output(output)
    return TraceResult(graph_module=torch.fx.GraphModule(module, graph), opaque=[])


class CompiledGraph:
    """What :data:`BACKEND` returns for one dynamo graph: a call runs it through the owner on top of this
    thread's stack (``owner.run_graph(self, args)``), or as dynamo's graph where there is none.

    Attributes:
        graph_module: dynamo's graph (inputs as dynamo passes them).
        layout: its :class:`GraphLayout`.
        ends: the break at its end (None where the frame returned).
        index: a number, in the order dynamo handed graphs over in this process.
    """

    _count = 0

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list):
        CompiledGraph._count += 1
        self.index = CompiledGraph._count
        self.graph_module = gm
        self.layout = layout_of(gm, example_inputs)
        reason = getattr(gm, "compile_subgraph_reason", None)
        self.ends = break_of(reason) if reason is not None and reason.graph_break else None
        self.lines = _lines_of(gm)

    def __call__(self, *args: Any) -> Any:
        stack = getattr(_OWNERS, "stack", None)
        if stack:
            return stack[-1].run_graph(self, args)
        return self.graph_module(*args)

    def host(self, args: tuple, training: bool) -> torch.fx.GraphModule:
        """The host module of this graph for a call with ``args`` (whose bound values it holds)."""
        return host_module(self.graph_module, self.layout, [args[i] for i in self.layout.bound], training)


def _backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    return CompiledGraph(gm, example_inputs)


# fxforge's TorchDynamo backend: one function for the process (dynamo guards on the backend's identity).
BACKEND = _backend


class owning:
    """Make ``owner`` run the graphs called on this thread inside the ``with`` block.

    Example:
        >>> with owning(object()):
        ...     len(_OWNERS.stack)
        1
    """

    def __init__(self, owner: Any):
        self.owner = owner

    def __enter__(self) -> Any:
        stack = getattr(_OWNERS, "stack", None)
        if stack is None:
            stack = _OWNERS.stack = []
        stack.append(self.owner)
        return self.owner

    def __exit__(self, *exc: object) -> None:
        _OWNERS.stack.pop()


def break_of(reason: Any) -> Break | None:
    """The :class:`~fxforge.core.breaks.Break` of dynamo's ``GraphCompileReason`` (its user's innermost frame).

    Example:
        >>> break_of(None) is None
        True
    """
    if reason is None or not reason.user_stack:
        return None
    frame = reason.user_stack[-1]
    return explain_break(reason.reason, frame.filename, frame.lineno or 0, frame.line or "")


def _lines_of(gm: torch.fx.GraphModule) -> str:
    """``file.py:3-9``: the user's lines the graph's nodes came from (first file), or ""."""
    found: dict[str, list[int]] = {}
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace") or ""
        for filename, lineno in re.findall(r'File "([^"]+)", line (\d+)', trace)[-1:]:
            found.setdefault(filename, []).append(int(lineno))
    if not found:
        return ""
    filename, lines = next(iter(found.items()))
    low, high = min(lines), max(lines)
    return format_location(filename, f"{low}-{high}" if high != low else low)


def dynamo_breaks_since(mark: tuple[int, int]) -> list[Break]:
    """The breaks dynamo met in this process since :func:`break_mark` gave ``mark``: those it cut a graph at
    (``torch._dynamo.utils.graph_break_reasons``; breaks before an empty graph included), and those that made it
    run a whole function in Python (a break inside a loop: the calls inside it are compiled as frames of their
    own), from its compilation metrics.

    Example:
        >>> dynamo_breaks_since(break_mark())
        []
    """
    from torch._dynamo.utils import get_compilation_metrics, graph_break_reasons

    _, frames = break_mark()
    found = [b for b in map(break_of, graph_break_reasons[mark[0]:]) if b is not None]
    for metrics in get_compilation_metrics()[-(frames - mark[1]):] if frames > mark[1] else ():
        filename, lineno = metrics.fail_user_frame_filename, metrics.fail_user_frame_lineno
        if metrics.fail_reason and filename and lineno:
            whole = explain_break(metrics.fail_reason, filename, int(lineno),
                                  linecache.getline(filename, int(lineno)))
            found.append(dataclasses.replace(whole, reason=whole.reason + f"; dynamo runs {metrics.co_name}() in "
                                             "Python (a break inside a loop), each call inside it a graph of its own"))
    return distinct(found)


# Breaks seen per function dynamo ran: dynamo names a break only while it compiles a frame, and a frame it runs in
# Python (a break inside a loop) is never compiled again, so a later model of the same class learns them here.
_KNOWN_BREAKS: dict[tuple, list[Break]] = {}


def known_breaks(forward: Callable[..., Any], new: list[Break] = ()) -> list[Break]:
    """The breaks seen so far in ``forward``'s code (any instance's), with ``new`` ones added to them.

    Example:
        >>> def f(x): return x
        >>> known_breaks(f, [Break("m.py:2", "r", "f")]) == known_breaks(f)
        True
    """
    code = getattr(forward, "__code__", None)
    if code is None:
        return distinct(list(new))
    key = (code.co_filename, code.co_firstlineno, code.co_qualname)  # (equal code objects in two files differ)
    if new:
        _KNOWN_BREAKS[key] = distinct([*_KNOWN_BREAKS.get(key, []), *new])
    return list(_KNOWN_BREAKS.get(key, []))


def break_mark() -> tuple[int, int]:
    """Where dynamo's records of breaks end now: its break reasons and the frames it tried to compile (see
    :func:`dynamo_breaks_since`)."""
    from torch._dynamo.utils import counters, graph_break_reasons

    return len(graph_break_reasons), counters["frames"]["total"]


@dataclasses.dataclass
class DynamoCapture:
    """The graphs one call of a model ran through dynamo, in order, and the breaks between them.

    Attributes:
        graphs: ``(CompiledGraph, host module, host inputs)`` per graph call, first call of each graph only.
        breaks: the breaks, in order, without repeats.
        calls: how many times each graph ran in that call (by :attr:`CompiledGraph.index`).
    """

    graphs: list[tuple[CompiledGraph, torch.fx.GraphModule, tuple]]
    breaks: list[Break]
    calls: dict[int, int]
    method: str = "dynamo"

    @property
    def graph_modules(self) -> list[torch.fx.GraphModule]:
        """Each graph's host module (the model's parameters as its attributes), in the order the model ran them."""
        return [host for _, host, _ in self.graphs]


class _Collector:
    """An owner that records each graph's host and inputs and runs dynamo's graph as it is."""

    def __init__(self, training: bool):
        self.training = training
        self.seen: list[tuple[CompiledGraph, torch.fx.GraphModule, tuple]] = []
        self.calls: dict[int, int] = {}

    def run_graph(self, graph: CompiledGraph, args: tuple) -> Any:
        self.calls[graph.index] = self.calls.get(graph.index, 0) + 1
        if self.calls[graph.index] == 1:
            kept = tuple(args[i] for i in graph.layout.kept)
            self.seen.append((graph, graph.host(args, self.training), kept))
        return graph.graph_module(*args)


def compiled_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` under TorchDynamo with fxforge's backend (automatic dynamic sizes, as ``torch.compile``).

    Example:
        >>> compiled_forward(torch.nn.ReLU().forward)(-torch.ones(1)).tolist()
        [0.0]
    """
    return torch.compile(forward, backend=BACKEND)


def capture_dynamo(model: nn.Module, example_inputs: Any = None, *, example_kwargs: dict | None = None,
                   forward: Callable[..., Any] | None = None) -> DynamoCapture:
    """Run ``model`` once through dynamo on the example inputs (without gradients) and return its graphs (as
    host modules with the inputs they took) and its breaks.

    Example:
        >>> found = capture_dynamo(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
        >>> len(found.graphs), found.breaks
        (1, [])
    """
    args, kwargs = normalize_inputs(example_inputs)
    kwargs.update(example_kwargs or {})
    collector = _Collector(model.training)
    mark, forward = break_mark(), forward or model.forward
    with torch.no_grad(), owning(collector):
        compiled_forward(forward)(*args, **kwargs)
    ends = [graph.ends for graph, _, _ in collector.seen if graph.ends is not None]
    return DynamoCapture(collector.seen, known_breaks(forward, ends + dynamo_breaks_since(mark)), collector.calls)
