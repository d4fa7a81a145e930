"""What one training step costs in one process, and which of it tensor parallelism divides.

The planner prices every mesh from these figures:

- the step's forward + backward seconds and the optimizer's, **measured** in this process at the threads
  one rank will have (the roofline estimate, :func:`fxforge.core.costs.node_seconds`, stands in on meta
  tensors, for models planned on paper);
- the share of the forward + backward time that tensor parallelism divides by its degree: the nodes of
  the layers it splits (``colwise``, ``rowwise``, ``vocab``) and the nodes between a column-split layer
  and the row-split one it feeds (attention's scores and softmax, the MLP's activation): they run on
  ``1/tp`` of the heads or features. Norms, residual adds and everything else run whole on each rank. A
  backward node counts with the forward node it differentiates (the autograd sequence number);
- the same split for the activations saved for backward (a column-split layer saves its whole input, a
  row-split one its split input).

Example:
    >>> regions = sharded_regions({"attn.q": "colwise", "attn.o": "rowwise", "norm": "sequence"})
    >>> regions, node_is_sharded(["attn"], {"attn.q": "colwise", "attn.o": "rowwise"}, regions)
    ({'attn'}, True)
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from fxforge.core.memory import tensor_leaves
from fxforge.parallel.units import module_stack

SPLIT_STYLES = ("colwise", "rowwise", "vocab")
"""The styles whose layers' matrix products tensor parallelism divides."""


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def sharded_regions(styles: dict[str, str]) -> set[str]:
    """The modules holding both a column-split layer and a row-split one as direct children: what runs in
    them between the two (not inside another child) runs on split heads or features.

    Example:
        >>> sorted(sharded_regions({"h.0.mlp.up": "colwise", "h.0.mlp.down": "rowwise", "h.0.ln": "sequence"}))
        ['h.0.mlp']
    """
    col = {_parent(n) for n, s in styles.items() if s == "colwise"}
    row = {_parent(n) for n, s in styles.items() if s == "rowwise"}
    return col & row


def node_is_sharded(stack: list[str], styles: dict[str, str], regions: set[str]) -> bool:
    """Whether a node run inside the modules ``stack`` (outermost first) is divided by tensor parallelism:
    inside a split layer, or inside a region and not inside a child of it that runs whole (a norm, a
    replicated layer, a column-split layer's own input side is the layer itself and counts as split)."""
    for i, module in enumerate(stack):
        style = styles.get(module)
        if style in SPLIT_STYLES:
            return True
        if module in regions:
            inner = stack[i + 1:]
            return not any(styles.get(m) in ("sequence", "replicate") for m in inner)
    return False


def saved_is_sharded(module: str, styles: dict[str, str], regions: set[str]) -> bool:
    """Whether what ``module``'s operations saved for backward is split: a row-split layer's input and what
    a region computes between its layers are; a column-split layer saves its whole input."""
    style = styles.get(module)
    if style == "rowwise":
        return True
    if style in ("colwise", "vocab", "sequence", "replicate"):
        return False
    parts = module.split(".") if module else []
    prefixes = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]
    return any(p in regions for p in prefixes) and not any(styles.get(p) in ("colwise", "vocab", "sequence",
                                                                              "replicate") for p in prefixes)


_PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")


def _layer_style(stack: list[str], styles: dict[str, str]) -> str | None:
    return next((styles[m] for m in reversed(stack) if styles.get(m) in SPLIT_STYLES), None)


def split_forward_nodes(graph: torch.fx.Graph, styles: dict[str, str]) -> tuple[set[torch.fx.Node], set[torch.fx.Node]]:
    """Follow tensor parallelism's split through a forward graph: the nodes whose work it divides, and those
    whose result is split (on heads or features).

    A column-split layer's nodes give split results; what consumes a split result gives one too (attention's
    scores and softmax, the MLP's activation, wherever their modules sit), up to a row-split layer, whose
    matrix product gives whole partial sums (all-reduced). A row-split layer's and a vocabulary layer's work
    is divided, their results whole.

    Example:
        >>> class MLP(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
        ...     def forward(self, x):
        ...         return x + self.down(torch.relu(self.up(x)))
        >>> gm = torch.fx.symbolic_trace(MLP())
        >>> for n in gm.graph.nodes:
        ...     n.meta["nn_module_stack"] = {n.target: (n.target, None)} if n.op == "call_module" else {}
        >>> work, split = split_forward_nodes(gm.graph, {"up": "colwise", "down": "rowwise"})
        >>> sorted(n.name for n in work), sorted(n.name for n in split)
        (['down', 'relu', 'up'], ['relu', 'up'])
    """
    work: set[torch.fx.Node] = set()
    split: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op not in ("call_function", "call_module", "call_method"):
            continue
        style = _layer_style(module_stack(node), styles)
        fed = any(i in split for i in node.all_input_nodes)
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if style == "colwise":
            work.add(node)
            split.add(node)
        elif style == "rowwise":
            work.add(node)
            if fed and node.op != "call_module" and name not in _PRODUCTS:  # not the product itself
                split.add(node)
        elif style == "vocab":
            work.add(node)
        elif fed:
            work.add(node)
            split.add(node)
    return work, split


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """One process's training step, measured (or estimated on meta tensors).

    Attributes:
        forward_backward_s: forward + backward seconds on the whole batch.
        optimizer_s: the optimizer's step.
        measured: True when timed, False for the roofline estimate.
        threads: the threads it ran on.
        node_seconds: the roofline seconds of each node of the step's graphs, for the shares.
        stacks: each node's module stack (backward nodes: their forward node's).
        owners: each node's forward node (itself, or the one a backward node differentiates; None where
            unknown), with ``forward``, the forward graph the split is followed through; without them a node
            counts as split inside a split layer only.
        forward: the step's forward graph.
    """

    forward_backward_s: float
    optimizer_s: float
    measured: bool
    threads: int
    node_seconds: list[float]
    stacks: list[list[str]]
    owners: tuple = ()
    forward: Any = None

    def sharded_share(self, styles: dict[str, str]) -> float:
        """The share of the forward + backward time a tensor-parallel plan with ``styles`` divides.

        Example:
            >>> costs = StepCosts(1.0, 0.1, True, 1, [3.0, 1.0], [["mlp", "mlp.up"], ["ln"]])
            >>> costs.sharded_share({"mlp.up": "colwise", "mlp.down": "rowwise"})
            0.75
        """
        total = sum(self.node_seconds)
        if not total:
            return 0.0
        if self.forward is None:
            regions = sharded_regions(styles)
            return sum(s for s, stack in zip(self.node_seconds, self.stacks)
                       if node_is_sharded(stack, styles, regions)) / total
        work, _ = split_forward_nodes(self.forward, styles)
        split = sum(s for s, owner, stack in zip(self.node_seconds, self.owners, self.stacks)
                    if (owner in work if owner is not None else _layer_style(stack, styles) is not None))
        return split / total


def graph_shares(step: Any, machine: Any) -> tuple[list[float], list[list[str]], tuple]:
    """Each node's roofline seconds, module stack and forward node (:attr:`StepCosts.owners`) over the step's
    forward and backward graphs."""
    from fxforge.core.costs import node_seconds

    seconds, stacks, owners = [], [], []
    by_seq: dict[int, torch.fx.Node] = {}
    for node in step.forward.graph.nodes:
        if node.op != "call_function":
            continue
        if (seq := node.meta.get("seq_nr")) is not None:
            by_seq.setdefault(seq, node)
        seconds.append(node_seconds(node, machine))
        stacks.append(module_stack(node))
        owners.append(node)
    for node in step.backward.graph.nodes:
        if node.op != "call_function":
            continue
        owner = by_seq.get(node.meta.get("seq_nr"))
        seconds.append(node_seconds(node, machine))
        stacks.append(module_stack(owner) if owner is not None else module_stack(node))
        owners.append(owner)
    return seconds, stacks, tuple(owners)


def time_step(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Any, optimizer_factory: Any, *,
              threads: int, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of forward + backward, and of the optimizer's step, on ``threads`` threads (after one
    warm-up step; the model's parameters and gradients are put back)."""
    from fxforge.training.measure import restored

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    fb, opt_s = [], []
    try:
        with restored(model):
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = optimizer_factory(params) if optimizer_factory is not None else None
            for i in range(repeats + 1):
                for p in params:
                    p.grad = None
                start = time.perf_counter()
                loss_fn(model(*args, **kwargs), None).backward()
                middle = time.perf_counter()
                if optimizer is not None:
                    optimizer.step()
                end = time.perf_counter()
                if i:
                    fb.append(middle - start)
                    opt_s.append(end - middle)
    finally:
        torch.set_num_threads(previous)
    return statistics.median(fb), statistics.median(opt_s)


def is_meta(args: tuple, kwargs: dict, model: torch.nn.Module) -> bool:
    """Whether the model or its inputs live on the meta device (planning on paper)."""
    return any(t.is_meta for t in [*tensor_leaves((args, kwargs)), *model.parameters()])
