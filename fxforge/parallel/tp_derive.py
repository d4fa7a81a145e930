"""The tensor-parallel plan of a model, derived from its forward graph (not from a table per architecture).

:func:`derive_tp_plan` traces the model on fake tensors (:mod:`fxforge.parallel.tp_trace`) and decides, for
every layer with parameters, one style of the vocabulary ``plan.tp_plan`` uses:

- ``"colwise"`` / ``"rowwise"``: linear layers whose split output reaches row-parallel linear layers through
  elementwise work, views and attention only (:mod:`fxforge.parallel.tp_groups`): attention's q, k, v
  (by whole heads: a head count, or a KV head count, the degree does not divide keeps the attention whole),
  MLP up/gate and down. A per-head embedding feeding the attention scores (T5's relative position bias) is
  column-parallel with them: each rank keeps its heads' columns.
- ``"vocab"``: embeddings indexed by the model's input tokens, and the LM head (a linear layer tied to such an
  embedding, or with as many outputs as it has rows), split over the vocabulary.
- ``"sequence"``: norms and dropouts between the blocks, split over the sequence, when sequence parallelism
  applies (:mod:`fxforge.parallel.tp_sequence`).
- ``"replicate"``: everything else, each with the reason (``plan.reasons``).

A fused projection (GPT-2's ``c_attn`` computing q, k and v in one matmul, then ``split``) is replicated:
split by columns, rank 0 would hold all of q and half of k, and the model's ``split`` would cut the local
block wrongly; the graph shows it as a ``split`` along the split dimension, and the attention (with its
``c_proj``) stays whole with that reason. (Splitting each third would need a strided layout and a changed
``split_size``.) The MLP's ``Conv1D`` layers are split (weight ``[in, out]``: the dimensions swapped).

Where the split values pass through code that sizes tensors from module attributes (a view by
``self.num_heads``, T5's ``zeros(1, self.n_heads, ...)``), those attributes are divided by the degree when
the plan is built (``plan.edits``). Linear layers that read one replicated input (q, k and v of one
attention) receive it once, through ``PrepareModuleInput`` on the module around them (``plan.gathers``): one
collective in the backward instead of one per layer.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> plan = derive_tp_plan(model, (torch.randn(4, 8),), degree=2)
    >>> plan.styles
    {'0': 'colwise', '2': 'rowwise'}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fxforge.parallel.tp_groups import is_linear, own_failure, solve_groups, upstream_linears
from fxforge.parallel.tp_sequence import derive_sequence
from fxforge.parallel.tp_trace import (
    TracedForward,
    base_of,
    is_marker,
    output_of,
    slot_of,
    trace_forward,
    value_users,
)

STYLES = ("colwise", "rowwise", "sequence", "vocab", "replicate")


@dataclasses.dataclass
class TensorParallelPlan:
    """Where each layer goes under tensor parallelism of one degree.

    Attributes:
        styles: module qualname -> "colwise" | "rowwise" | "sequence" | "vocab" | "replicate".
        reasons: module qualname -> why it is replicated (every "replicate" has one).
        degree: the tensor-parallel degree.
        sequence_parallel: norms and dropouts between the blocks run split over the sequence.
        sequence_reason: why sequence parallelism does not apply ("" when it does, or was not asked for).
        edits: module -> attribute -> (value, value // degree): attributes the local shapes need.
        gathers: module -> (slot, positional argument count): where one replicated input of several
            column-parallel layers is prepared once (``PrepareModuleInput``).
        gather_outputs: modules whose output several column-parallel layers read, made one replicated DTensor
            there (``PrepareModuleOutput``) when no module call receives it alone.
        gathered: the column-parallel layers whose input one of ``gathers`` or ``gather_outputs`` prepares.
        entries: modules whose output the sequence split starts from (``PrepareModuleOutput``).
        entry_inputs: module -> (slot, positional count): inputs the sequence split starts from.
        exits: "sequence" modules whose output is gathered back to full sequences for what follows.
        split_outputs: "vocab" embeddings whose output starts the sequence split (reduce-scatter).
        seq_inputs: modules whose input is split over the sequence, gathered before use (the layers and the
            ``gathers`` modules reading the stream).
        tied: groups of parameter names that are one tensor (kept one after sharding).
        kinds: module -> "linear" | "transposed_linear" (GPT-2's ``Conv1D``) | "embedding" | "other".
    """

    styles: dict[str, str]
    reasons: dict[str, str]
    degree: int
    sequence_parallel: bool = False
    sequence_reason: str = ""
    edits: dict[str, dict[str, tuple[int, int]]] = dataclasses.field(default_factory=dict)
    gathers: dict[str, tuple[int | str, int]] = dataclasses.field(default_factory=dict)
    entries: list[str] = dataclasses.field(default_factory=list)
    entry_inputs: dict[str, tuple[int | str, int]] = dataclasses.field(default_factory=dict)
    exits: list[str] = dataclasses.field(default_factory=list)
    split_outputs: list[str] = dataclasses.field(default_factory=list)
    tied: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    gather_outputs: list[str] = dataclasses.field(default_factory=list)
    gathered: list[str] = dataclasses.field(default_factory=list)
    seq_inputs: list[str] = dataclasses.field(default_factory=list)

    def of_style(self, style: str) -> list[str]:
        """The modules of one style, in the model's order.

        Example:
            >>> TensorParallelPlan({"a": "colwise", "b": "rowwise"}, {}, 2).of_style("rowwise")
            ['b']
        """
        return [name for name, s in self.styles.items() if s == style]

    def __str__(self) -> str:
        why = f" ({self.sequence_reason})" if self.sequence_reason else ""
        lines = [f"tensor parallel, degree {self.degree}, sequence parallel: "
                 + ("yes" if self.sequence_parallel else "no" + why)]
        for name, style in self.styles.items():
            why = f"  ({self.reasons[name]})" if name in self.reasons else ""
            lines.append(f"  {name}: {style}{why}")
        return "\n".join(lines)


def tied_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    """Names of parameters that are one tensor (GPT-2's LM head and token embedding).

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False))
        >>> m[1].weight = m[0].weight
        >>> tied_parameters(m)
        [('0.weight', '1.weight')]
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def _owner(parameter: str) -> str:
    return parameter.rpartition(".")[0]


def _indexed_by_input(traced: TracedForward, module: str) -> bool:
    """Whether the embedding's lookups take the model's own inputs (token ids), through views only."""
    for node in traced.graph.nodes:
        if node.op == "call_function" and traced.module_of(node) == module and "embedding" in str(node.target):
            index = node.args[1]
            while isinstance(index, torch.fx.Node) and index.op == "call_function" and (
                    "view" in str(index.target) or "unsqueeze" in str(index.target) or is_marker(index)):
                index = index.args[0]
            return index in traced.user_inputs
    return False


def _gathers(traced: TracedForward, colwise: set[str],
             linears: set[str]) -> tuple[dict[str, tuple[int | str, int]], list[str], list[str]]:
    """For each replicated value several column-parallel linear layers read, where to make it one replicated
    DTensor for all of them: the innermost module call that receives it (``PrepareModuleInput``), else the
    module that returns it (``PrepareModuleOutput``), whose every use of it is one of those layers.

    Returns:
        The input gathers (module -> (slot, positional count)), the output gathers, and the layers served.
    """
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for name in sorted(colwise & linears):  # a set: its order changes with the hash seed
        slot = traced.calls_of(name)[0].inputs.get(0)
        if slot is not None:
            readers.setdefault(base_of(slot), []).append(slot)
    inputs: dict[str, tuple[int | str, int]] = {}
    outputs: list[str] = []
    served: list[str] = []
    for slots in readers.values():
        if len(slots) < 2:
            continue
        chains = []
        for slot in slots:
            chain, node = [], slot.args[0]
            while is_marker(node):
                chain.append(node)
                node = node.args[0]
            chains.append(chain)
        names = {slot_of(s)[0] for s in slots}
        for marker in [n for n in chains[0] if all(n in c for c in chains[1:])]:  # innermost first
            if not all(traced.module_of(u) in names for u in value_users(marker) if u.op != "output"):
                continue
            where = slot_of(marker) or output_of(marker)
            calls = traced.calls_of(where[0])
            if slot_of(marker):
                call = next(c for c in calls if marker in c.inputs.values())
                inputs[where[0]] = (where[1], call.positional)
            elif len(calls) == 1 and calls[0].arity == 1:
                outputs.append(where[0])
            else:
                continue
            served += sorted(names)
            break
    return inputs, outputs, served


def derive_tp_plan(model: nn.Module, example_inputs: Any, degree: int, *,
                   sequence_parallel: bool | None = None) -> TensorParallelPlan:
    """Derive the tensor-parallel plan of ``model`` from its forward graph (module docstring).

    Args:
        model: the model (left unchanged).
        example_inputs: a tuple of positional inputs, one tensor, or a dict of keyword inputs.
        degree: the number of ranks each layer is split over (> 1).
        sequence_parallel: True or False to ask for it (True where it cannot apply still leaves it off, with
            ``plan.sequence_reason``); None (default) applies it where it can.

    Returns:
        The :class:`TensorParallelPlan` (``apply_tp`` in :mod:`fxforge.parallel.tp_build` builds it).
    """
    if degree < 2:
        raise ValueError(f"degree {degree}: tensor parallelism needs at least 2 ranks")
    traced = trace_forward(model, example_inputs)
    modules = dict(model.named_modules())
    linears = {name for name, m in modules.items() if is_linear(m)}
    embeddings = {name for name, m in modules.items() if isinstance(m, nn.Embedding)}
    reasons: dict[str, str] = {}
    candidates = set()
    for name in sorted(linears | embeddings):
        count = len(traced.calls_of(name))
        if count == 0:
            reasons[name] = "not called in the forward"
        elif count > 1 and name in linears:
            reasons[name] = f"called {count} times in one forward: its calls would all have to pair alike"
        else:
            candidates.add(name)
    groups, failed = solve_groups(traced, model, candidates, degree)
    styles: dict[str, str] = {}
    edits: dict[str, dict[str, tuple[int, int]]] = {}
    for group in groups:
        styles.update({name: "colwise" for name in group.sources})
        styles.update({name: "rowwise" for name in group.sinks})
        for module, attrs in group.edits.items():
            edits.setdefault(module, {}).update(attrs)

    vocab_rows = {}
    for name in sorted(embeddings - set(styles)):
        rows = modules[name].num_embeddings
        if not traced.calls_of(name):
            continue
        if not _indexed_by_input(traced, name):
            reasons[name] = ("indexed by positions or types the model computes, not by its input tokens: a "
                             "table kept whole")
        elif rows % degree:
            reasons[name] = f"{rows} rows do not divide by the degree {degree}"
        else:
            styles[name] = "vocab"
            vocab_rows[name] = rows
    tied = tied_parameters(model)
    tied_to = {_owner(p): {_owner(q) for q in group} for group in tied for p in group}
    for name in sorted(linears - set(styles)):
        layer = modules[name]
        outputs = layer.nf if not isinstance(layer, nn.Linear) else layer.out_features
        partners = tied_to.get(name, set()) & set(vocab_rows)
        if traced.calls_of(name) and isinstance(layer, nn.Linear) and not outputs % degree and (
                partners or outputs in vocab_rows.values()):
            styles[name] = "vocab"
    for group in tied:  # one tensor, one placement: vocab everywhere or nowhere
        owners = {_owner(p) for p in group}
        called = {o for o in owners if traced.calls_of(o)}
        kinds = {styles.get(o, "replicate") for o in called}
        if "vocab" in kinds and kinds != {"vocab"}:
            for owner in owners:
                if styles.get(owner) == "vocab":
                    del styles[owner]
                    reasons[owner] = (f"its weight is tied to {', '.join(sorted(owners - {owner}))}, which is not split "
                                      "over the vocabulary")
        elif kinds == {"vocab"}:
            for owner in owners - called:  # holds the same tensor, split like the others
                styles[owner] = "vocab"
                reasons.pop(owner, None)

    for name in sorted(linears | embeddings):
        if name not in styles and name not in reasons:
            reasons[name] = failed.get(name) or "not paired with another linear layer"
    for name in sorted(linears):
        if styles.get(name) is None and traced.calls_of(name):
            whole = [u for u in upstream_linears(traced, linears, name) if u not in styles]
            own = failed.get(name) or own_failure(traced, model, name, degree) or reasons[name]
            reasons[name] = (f"not row-parallel: its input comes from {', '.join(whole)} (kept whole); not "
                             f"column-parallel: {own}") if whole else own
    for name, module in modules.items():
        if name not in styles and name not in reasons and any(True for _ in module.parameters(recurse=False)):
            reasons[name] = f"{type(module).__name__} is not split by tensor parallelism: kept whole on every rank"
    order = {name: i for i, name in enumerate(modules)}
    final = {name: styles.get(name, "replicate") for name in sorted(set(styles) | set(reasons), key=order.get)}
    plan = TensorParallelPlan(final, {k: v for k, v in reasons.items() if final.get(k) == "replicate"}, degree,
                              edits=edits, tied=tied)
    plan.gathers, plan.gather_outputs, plan.gathered = _gathers(traced, set(plan.of_style("colwise")), linears)
    plan.kinds = {name: _kind(modules[name]) for name in final}
    if sequence_parallel is not False:
        sequence = derive_sequence(traced, model, plan, degree)
        plan.sequence_reason = sequence.reason
        if not sequence.reason:
            plan.sequence_parallel = True
            for name in sequence.modules:
                plan.styles[name] = "sequence"
                plan.reasons.pop(name, None)
            plan.entries, plan.entry_inputs, plan.exits = sequence.entries, sequence.entry_inputs, sequence.exits
            plan.split_outputs, plan.seq_inputs = sequence.split_outputs, sequence.seq_inputs
            plan.kinds.update({name: _kind(modules[name]) for name in sequence.modules})
    return plan


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear):
        return "linear"
    return "transposed_linear" if is_linear(module) else "other"

