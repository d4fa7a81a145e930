"""Every output of a pipelined model returned by its last stage.

``torch.distributed.pipelining`` returns what the last stage returns. A model output computed in an earlier
stage and used by no later one (T5's ``encoder_last_hidden_state`` when the split falls in the decoder, a
model that returns an intermediate feature map) appears in the pipe's root graph as an output of that earlier
stage: the schedule never returns it, the loss on the last stage never sees it, and its gradient is lost.
:func:`outputs_from_last_stage` edits the pipe so that each such value is handed on, stage by stage, to the
last one, which returns it beside its own outputs, in the model's output order. A handed-on value is the
received tensor returned as it is, so its gradient flows back the same way.

Example:
    >>> from torch.distributed.pipelining import SplitPoint, pipeline
    >>> class TwoHeads(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    ...     def forward(self, x):
    ...         h = self.a(x)
    ...         return self.c(self.b(h)), h
    >>> pipe = pipeline(TwoHeads(), (torch.randn(2, 4),), split_spec={"b": SplitPoint.BEGINNING,
    ...                                                                 "c": SplitPoint.BEGINNING})
    >>> outputs_from_last_stage(pipe)
    1
    >>> [(n.args[0].name, n.args[1]) for n in pipe.split_gm.graph.output_node().args[0]]
    [('submod_pp_2', 0), ('submod_pp_2', 1)]
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

__all__ = ["outputs_from_last_stage"]


def outputs_from_last_stage(pipe: Any) -> int:
    """Edit ``pipe`` (a ``torch.distributed.pipelining`` ``Pipe``) so its last stage returns every output of
    the model; returns how many outputs were handed on from earlier stages.

    Raises:
        ValueError: a model output is one of the model's own inputs (no stage computes it to hand on).
    """
    root = pipe.split_gm
    graph = root.graph
    stages = [node for node in graph.nodes if node.op == "call_module"]
    output = graph.output_node()
    handed = 0
    while True:
        # Handing a value on turns a stage that returned one value into one returning a tuple, and rewrites
        # the output's reference to it: the outputs are read again after each.
        earlier = [node for node in output.all_input_nodes if _stage_index(node, stages) != len(stages) - 1]
        if not earlier:
            break
        output.replace_input_with(earlier[0], _hand_on(root, stages, earlier[0]))
        handed += 1
    if handed:
        for stage in stages[1:]:
            _receive_in_send_order(root, stages, stage)
        _last_returns_in_output_order(root, stages[-1])
        graph.lint()
        root.recompile()
    return handed


def _receive_in_send_order(root: torch.fx.GraphModule, stages: list[Node], stage: Node) -> None:
    """Order a stage's inputs (and its placeholders with them) as their senders send them: by sending stage,
    then by output index. The engine's sends and receives between two ranks pair up in the order they are
    posted, so an input handed on after the stage's own would otherwise receive another value."""
    module = root.get_submodule(str(stage.target))
    placeholders = list(module.graph.find_nodes(op="placeholder"))

    def sent_order(pair: tuple[Any, Node]) -> tuple[int, int]:
        arg = pair[0]
        source = _stage_index(arg, stages) if isinstance(arg, Node) else None
        index = arg.args[1] if isinstance(arg, Node) and arg.target is operator.getitem else 0
        return (-1 if source is None else source, index)

    pairs = sorted(zip(stage.args, placeholders, strict=True), key=sent_order)
    stage.args = tuple(arg for arg, _ in pairs)
    body = next(node for node in module.graph.nodes if node.op != "placeholder")
    for _, placeholder in pairs:
        body.prepend(placeholder)
    module.recompile()


def _last_returns_in_output_order(root: torch.fx.GraphModule, last: Node) -> None:
    """The schedule returns the last stage's own tuple, not the root graph's output: the last stage returns
    the model's outputs in the root output's order (each read by its index)."""
    module = root.get_submodule(str(last.target))
    returned = list(module.graph.output_node().args[0])
    output = root.graph.output_node()
    reads: list[Node] = []
    torch.fx.node.map_arg(output.args, reads.append)      # the root output's nodes, in its order
    module.graph.output_node().args = (tuple(returned[read.args[1]] for read in reads),)
    module.recompile()
    with root.graph.inserting_after(last):
        ordered = iter([root.graph.call_function(operator.getitem, (last, i)) for i in range(len(reads))])
    output.args = torch.fx.node.map_arg(output.args, lambda _: next(ordered))
    for read in dict.fromkeys(reads):
        root.graph.erase_node(read)


def _stage_index(value: Node, stages: list[Node]) -> int | None:
    node = value
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return stages.index(node) if node in stages else None


def _hand_on(root: torch.fx.GraphModule, stages: list[Node], value: Node) -> Node:
    """``value`` (an output of an earlier stage) passed through every later stage; the last stage's getitem
    that returns it."""
    source = _stage_index(value, stages)
    if source is None:
        raise ValueError(f"the model returns {value.name}, which no pipeline stage computes (one of its own "
                         "inputs): a pipeline returns only what its stages compute")
    val = _produced_val(root, stages[source], value)
    current = value
    for stage in stages[source + 1:]:
        module = root.get_submodule(str(stage.target))
        if current in stage.args:
            placeholder = list(module.graph.find_nodes(op="placeholder"))[stage.args.index(current)]
        else:
            placeholder = _add_placeholder(module, f"handed_{value.name}", val)
            stage.args = (*stage.args, current)
        index = _return_also(root.graph, stage, module, placeholder)
        with root.graph.inserting_after(_last_getitem(stage)):
            current = root.graph.call_function(operator.getitem, (stage, index))
        module.recompile()
    return current


def _produced_val(root: torch.fx.GraphModule, stage: Node, value: Node) -> Any:
    """The example value (``meta["val"]``) of ``value`` as its stage returns it."""
    returned = root.get_submodule(str(stage.target)).graph.output_node().args[0]
    if value is stage:
        node = returned
    else:
        node = list(returned)[value.args[1]]
    return node.meta.get("val")


def _add_placeholder(module: torch.fx.GraphModule, name: str, val: Any) -> Node:
    placeholders = list(module.graph.find_nodes(op="placeholder"))
    with module.graph.inserting_after(placeholders[-1]):
        node = module.graph.placeholder(name)
    if val is not None:
        node.meta["val"] = val
    return node


def _return_also(graph: torch.fx.Graph, stage: Node, module: torch.fx.GraphModule, value: Node) -> int:
    """Add ``value`` to what ``module`` returns (a tuple from now on) and return its index. A stage that
    returned one value had its users read it directly: they read item 0 from now on."""
    output = module.graph.output_node()
    returned = output.args[0]
    if isinstance(returned, (tuple, list)):
        output.args = ((*returned, value),)
        return len(returned)
    output.args = ((returned, value),)
    users = list(stage.users)
    with graph.inserting_after(stage):
        first = graph.call_function(operator.getitem, (stage, 0))
    for user in users:
        user.replace_input_with(stage, first)
    return 1


def _last_getitem(stage: Node) -> Node:
    getitems = [user for user in stage.users if user.op == "call_function" and user.target is operator.getitem]
    return max(getitems, key=lambda node: node.args[1]) if getitems else stage
