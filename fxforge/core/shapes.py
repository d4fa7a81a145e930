"""Shape, dtype and source metadata on every node.

:func:`annotate` fills ``node.meta['val']`` (a FakeTensor, or a pytree of them) and
``node.meta['tensor_meta']`` by running the graph under ``FakeTensorMode``, so no real compute happens.
Graphs from ``torch.export`` already carry ``val``; symbolic traces get it here. When fake propagation is
impossible (an opaque leaf whose control flow depends on data), the graph is run once on the real
example inputs instead and that is recorded.

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 3))
    >>> annotate(gm, (torch.ones(4, 2),), {}).source
    'fake'
    >>> [tuple(n.meta['val'].shape) for n in gm.graph.nodes if n.op == 'call_function']
    [(4, 3)]
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

from fxforge.core.nodes import attribute_tensor, call_node
from fxforge.core.source import first_line, user_line_of_stack_trace
from fxforge.core.verify import isolated


@dataclasses.dataclass(frozen=True)
class MetaInfo:
    """How node metadata was obtained: ``"fake"`` tensors, ``"export"`` (torch.export's own), ``"check"``
    (recorded during the real run that checks a capture, so it costs nothing extra), or ``"real"`` (one
    real run, with ``reason`` saying why fake propagation was impossible).

    Example:
        >>> MetaInfo("fake").source
        'fake'
    """

    source: str
    reason: str = ""


def placeholder_values(graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """The values the graph's placeholders take for a call ``graph_module(*args, **kwargs)``.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> len(placeholder_values(gm, (torch.ones(1),), {}))
        1
    """
    in_spec = getattr(graph_module, "_in_spec", None)
    if in_spec is not None:
        flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
        return flat
    signature = inspect.signature(graph_module.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return list(bound.arguments.values())


class _FakeProp(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, mode: FakeTensorMode):
        super().__init__(module, garbage_collect_values=True)
        self.mode = mode

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        _store(n, result)
        return result

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor):
            return self.mode.from_tensor(value, static_shapes=True)
        return value


class _RealProp(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, mode: FakeTensorMode):
        super().__init__(module, garbage_collect_values=True)
        self.mode = mode

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        fake = pytree.tree_map_only(torch.Tensor, lambda t: self.mode.from_tensor(t.detach(), static_shapes=True), result)
        _store(n, fake)
        return result


def _store(node: torch.fx.Node, value: Any) -> None:
    node.meta["val"] = value
    if isinstance(value, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(value)


def annotate_sources(graph_module: torch.fx.GraphModule) -> None:
    """Record the user's source line of each node (``node.meta['fxforge_source']``) where torch kept one.

    Example:
        >>> annotate_sources(torch.fx.symbolic_trace(torch.nn.ReLU()))
    """
    for node in graph_module.graph.nodes:
        line = user_line_of_stack_trace(node.meta.get("stack_trace"))
        if line:
            node.meta["fxforge_source"] = line


def run_and_annotate(graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict) -> tuple[Any, MetaInfo]:
    """Run ``graph_module`` on real ``args``/``kwargs`` (no grad, buffers and RNG restored) and record
    every node's metadata on the way; returns the outputs and ``MetaInfo("check")``.

    Capture checks its graph with one real run anyway; recording shapes during it is cheaper than a
    separate fake propagation (which, op by op, costs more than the run on small inputs).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 3))
        >>> out, info = run_and_annotate(gm, (torch.ones(4, 2),), {})
        >>> tuple(out.shape), info.source, tuple(list(gm.graph.nodes)[-2].meta["val"].shape)
        ((4, 3), 'check', (4, 3))
    """
    annotate_sources(graph_module)
    values = placeholder_values(graph_module, args, kwargs)
    with isolated(graph_module), torch.no_grad():
        outputs = _RealProp(graph_module, FakeTensorMode(allow_non_fake_inputs=True)).run(*values)
    return _plain_containers(outputs), MetaInfo("check")


def _plain_containers(value: Any) -> Any:
    """The interpreter returns torch.fx's immutable dicts/lists where generated code returns plain ones."""
    if isinstance(value, immutable_dict):
        return {k: _plain_containers(v) for k, v in value.items()}
    if isinstance(value, immutable_list):
        return [_plain_containers(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain_containers(v) for v in value)
    return value


def annotate(graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict, *, force: bool = False) -> MetaInfo:
    """Fill shape/dtype metadata on every node of ``graph_module`` for inputs like ``args``/``kwargs``.

    Args:
        graph_module: the graph to annotate (modified in place: ``node.meta``).
        args, kwargs: example inputs; only their shapes/dtypes are used unless fake propagation fails.
        force: re-propagate even if every node already has ``val`` (after a rewrite).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Flatten())
        >>> annotate(gm, (torch.ones(2, 3, 4),), {}).source
        'fake'
    """
    annotate_sources(graph_module)
    nodes = [n for n in graph_module.graph.nodes if n.op not in ("output",)]
    if not force and all("val" in n.meta for n in nodes):
        for node in nodes:  # torch.export fills 'val' everywhere but 'tensor_meta' only in places
            if isinstance(node.meta["val"], torch.Tensor) and "tensor_meta" not in node.meta:
                node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
        return MetaInfo("export")
    symbolic = _symbolic_placeholders(graph_module)
    if symbolic is not None:  # a shape-generic graph stays one: propagate its own symbolic input values
        mode = next(v.fake_mode for v in symbolic if isinstance(v, torch.Tensor))
        with isolated(graph_module), mode:
            _FakeProp(graph_module, mode).run(*symbolic)
        return MetaInfo("fake")
    values = placeholder_values(graph_module, args, kwargs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_values = [mode.from_tensor(v, static_shapes=True) if isinstance(v, torch.Tensor) else v for v in values]
    try:
        # Modules called by the graph see fake inputs but own real buffers: BatchNorm in training mode
        # would still count num_batches_tracked up, so buffers are restored afterwards.
        with isolated(graph_module), mode:
            _FakeProp(graph_module, mode).run(*fake_values)
        return MetaInfo("fake")
    except Exception as error:  # noqa: BLE001 - any failure means: fall back to one real run
        reason = first_line(error)
    with isolated(graph_module), torch.no_grad():
        _RealProp(graph_module, mode).run(*values)
    return MetaInfo("real", reason)


def _symbolic_placeholders(graph_module: torch.fx.GraphModule) -> list[Any] | None:
    """The placeholders' fake values when one has a symbolic size (the graph serves many shapes), else None."""
    values = [n.meta.get("val") for n in graph_module.graph.find_nodes(op="placeholder")]
    if any(isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape) for v in values):
        return values
    return None


def propagate_meta(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node],
                   result: tuple[torch.fx.Node, Any] | None = None) -> None:
    """Give nodes a rewrite just made ``meta['val']`` (fake tensors), so later rules in the same pass can check
    shapes without propagating through the whole graph again.

    ``result`` is ``(the node that replaces the match, the replaced value's val)``: that node computes the
    same value, so it gets a tensor of the same shape, strides and dtype (its own storage) without running
    its op on fake tensors (a fake convolution costs a millisecond; a rewrite makes one per match).
    Metadata is a convenience: a node it cannot be computed for is left without it.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU()); _ = annotate(gm, (torch.ones(2, 3),), {})
        >>> x = next(iter(gm.graph.nodes))
        >>> with gm.graph.inserting_after(x):
        ...     y = gm.graph.call_method("sum", (x, 0))
        >>> propagate_meta(gm, [y]); tuple(y.meta["val"].shape)
        (3,)
    """
    mode = next((n.meta["val"].fake_mode for n in gm.graph.nodes
                 if hasattr(n.meta.get("val"), "fake_mode")), None)
    if mode is None:
        return
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted(nodes, key=order.__getitem__):
        try:
            if result is not None and node is result[0] and isinstance(result[1], torch.Tensor):
                val = result[1]
                with mode:
                    node.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
                continue
            if node.op == "get_attr":
                node.meta["val"] = mode.from_tensor(attribute_tensor(gm, node.target), static_shapes=True)
                continue
            with mode:
                node.meta["val"] = call_node(node, lambda n: n.meta.get("val"))
        except Exception:  # noqa: BLE001 - metadata is a convenience; the pipeline re-annotates after the pass
            node.meta.pop("val", None)
