"""Sequence parallelism: the work between the tensor-parallel layers split over the sequence, read from the graph.

Under tensor parallelism, the values between a row-parallel layer and the next column-parallel ones (the
residual stream, the norms, dropouts) are computed whole on every rank. Sequence parallelism (Korthikanti
et al., 2022) splits them over the sequence instead: a row-parallel layer reduce-scatters its output over the
sequence instead of all-reducing it, and the input of the next column-parallel layers is all-gathered.

:func:`derive_sequence` finds that **stream** in the forward graph: starting from the row-parallel outputs
(3-D, ``(batch, sequence, features)``), it follows every op that works on each position alone (elementwise
ops, norms over the features, dropout, views that keep batch and sequence) up to the inputs of
column-parallel layers (where the sequence is gathered back). Values that join the stream from elsewhere
(the embeddings, the first residual) enter it where a module returns them: an embedding split over the
vocabulary reduce-scatters its output (torchtitan's layout), another module's output is cut over the
sequence (``PrepareModuleOutput``). A stream value read by anything else (a replicated attention, the
model's output, a pooler taking the first token) leaves the stream at the output of a norm or dropout,
gathered back. Norms and dropouts wholly on the stream become ``"sequence"`` (``SequenceParallel``); their
parameters are replicated.

It does not apply (``reason``) when the stream reaches an op that mixes positions without a module
boundary to gather at, when a parameter on the stream belongs to a module only partly on it, or when the
sequence does not divide by the degree.

BERT's LayerNorm comes after the residual add of a row-parallel output (post-LN): the add and the norm
are on the stream all the same (the add of two sequence-split values, the norm over features), so BERT's
norms are sequence-parallel too; its embeddings' LayerNorm normalizes a sum of three replicated lookups
and stays whole, the stream entering at its output.

Example:
    >>> from fxforge.parallel.tp_derive import derive_tp_plan
    >>> class Block(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.norm, self.up, self.down = torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    ...     def forward(self, x):
    ...         return x + self.down(torch.relu(self.up(self.norm(x))))
    >>> model = torch.nn.Sequential(Block(), Block(), torch.nn.LayerNorm(8))
    >>> plan = derive_tp_plan(model, (torch.randn(2, 4, 8),), degree=2)
    >>> plan.sequence_parallel, plan.of_style("sequence")
    (True, ['0.norm', '1.norm', '2'])
    >>> plan.entry_inputs, plan.exits       # cut where block 0 receives x; gathered after the final norm
    ({'0': (0, 1)}, ['2'])
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
from torch import nn

from fxforge.parallel.tp_shard import is_pointwise, shape_of
from fxforge.parallel.tp_trace import TracedForward, base_of, is_marker, output_of, slot_of, value_users

aten = torch.ops.aten
_IDENTITY = {aten.alias, aten.clone, aten.detach, aten._to_copy, aten.contiguous, aten.dropout,
             aten.native_dropout}
_PER_POSITION = {aten.mean, aten.sum, aten.var, aten.std, aten.amax, aten.amin, aten.var_mean, aten._softmax,
                 aten._log_softmax, aten.native_layer_norm, aten.view, aten._unsafe_view, aten.reshape}


@dataclasses.dataclass
class SequencePlan:
    """What sequence parallelism needs, or why it does not apply.

    Attributes:
        reason: why it does not apply ("" when it does).
        modules: the norms and dropouts wholly on the stream ("sequence").
        entries: modules whose output is cut over the sequence where it joins the stream.
        entry_inputs: module -> (slot, positional count): inputs cut over the sequence where they join it.
        exits: "sequence" modules whose output is gathered back for what reads it whole.
        split_outputs: embeddings split over the vocabulary whose output starts the stream.
        seq_inputs: modules (``PrepareModuleInput`` targets, column-parallel or vocabulary layers) whose input
            comes from the stream, gathered before use.
    """

    reason: str = ""
    modules: list[str] = dataclasses.field(default_factory=list)
    entries: list[str] = dataclasses.field(default_factory=list)
    entry_inputs: dict[str, tuple[int | str, int]] = dataclasses.field(default_factory=dict)
    exits: list[str] = dataclasses.field(default_factory=list)
    split_outputs: list[str] = dataclasses.field(default_factory=list)
    seq_inputs: list[str] = dataclasses.field(default_factory=list)


def _per_position(node: torch.fx.Node, seq: int) -> bool:
    """Whether ``node`` computes each (batch, position) from that position alone."""
    if node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", None)
    value = node.meta.get("val")
    first = value[0] if isinstance(value, (tuple, list)) else value
    if not isinstance(first, torch.Tensor) or first.dim() < 2 or first.shape[1] != seq:
        return False
    if packet in _IDENTITY or is_pointwise(node):
        return True
    if packet in _PER_POSITION:
        source = shape_of(node.args[0])
        if packet in (aten.view, aten._unsafe_view, aten.reshape):
            return source[:2] == tuple(first.shape[:2])
        if packet is aten.native_layer_norm:
            return len(node.args[1]) <= len(source) - 2
        dims = node.args[1] if len(node.args) > 1 else None
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        return dims[0] is not None and all(int(d) % len(source) >= 2 for d in dims)
    return False


def _is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem"


def _chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The markers from the value's producer up to ``node``, innermost first."""
    chain = []
    while is_marker(node):
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def derive_sequence(traced: TracedForward, model: nn.Module, tp: Any, degree: int) -> SequencePlan:
    """Find the stream and how it enters and leaves (module docstring); ``reason`` says why it cannot.

    ``tp`` is the tensor-parallel plan so far (its ``styles``, ``gathers``, ``gather_outputs``, ``gathered``).
    """
    modules = dict(model.named_modules())
    styles, gathers, gathered = tp.styles, tp.gathers, tp.gathered
    rowwise = [c.outputs.get(0) for name, s in styles.items() if s == "rowwise" for c in traced.calls_of(name)]
    if not rowwise or None in rowwise:
        return SequencePlan("no row-parallel layer to split the sequence after")
    shapes = {shape_of(n) for n in rowwise}
    if any(len(s) < 3 for s in shapes) or len({s[1] for s in shapes}) != 1:
        return SequencePlan(f"the row-parallel outputs {sorted(shapes)} have no common sequence dimension")
    seq = next(iter(shapes))[1]
    if seq % degree:
        return SequencePlan(f"the sequence of {seq} does not divide by the degree {degree}")
    readers: dict[torch.fx.Node, str] = {}
    for name, (slot, _) in gathers.items():
        readers.update({c.inputs[slot]: name for c in traced.calls_of(name) if slot in c.inputs})
    for name in tp.gather_outputs:
        readers.update({c.outputs[0]: name for c in traced.calls_of(name)})
    for name, style in styles.items():
        if (style == "colwise" and name not in gathered and not isinstance(modules[name], nn.Embedding)) or (
                style == "vocab" and not isinstance(modules[name], nn.Embedding)):
            readers.update({c.inputs[0]: name for c in traced.calls_of(name) if 0 in c.inputs})
    walk = _Walk(traced, readers, seq)

    # Values joining the stream enter it at the earliest module boundary on their way (innermost marker).
    seeds, chosen = list(rowwise), {}
    while True:
        walk.run(seeds, set())
        if walk.problem:
            return SequencePlan(walk.problem)
        new = []
        for value in walk.pulled:
            entry = _entry(traced, modules, styles, gathers, value)
            if entry is None:
                return SequencePlan(f"{base_of(value).name} {shape_of(value)} joins the sequence-split stream at no "
                                    "module boundary (called once) where it could be cut over the sequence")
            if entry[2] not in chosen:
                chosen[entry[2]] = entry
                new.append(entry[2])
        if not new:
            break
        seeds += new
    plan = SequencePlan()
    for kind, name, marker in chosen.values():
        if kind == "split":
            plan.split_outputs.append(name)
        elif kind == "output":
            plan.entries.append(name)
        else:
            plan.entry_inputs[name] = (slot_of(marker)[1], traced.calls_of(name)[0].positional)
    plan.modules = _sequence_modules(traced, modules, styles, walk.stream, set(plan.entries) | set(plan.entry_inputs))
    for owner in sorted(walk.owners - set(plan.modules)):
        return SequencePlan(f"the stream uses parameters of {owner}, which is not wholly on it")

    def real_users(node: torch.fx.Node) -> list[torch.fx.Node]:
        # (the forward graph's output also lists the values saved for backward; returned values leave the
        # stream through ``walk.leaving``)
        return [u for u in value_users(node) if u not in readers and u.op != "output"]

    stops: set[torch.fx.Node] = set()
    for value, user in list(walk.leaving.items()):
        markers = [m for m in [*_chain(value), *(u for u in value.users if is_marker(u))]
                   if output_of(m) and output_of(m)[0] in plan.modules and len(traced.calls_of(output_of(m)[0])) == 1]
        exit_at = next((m for m in reversed(markers) if not any(u in walk.stream for u in real_users(m))), None)
        if exit_at is None:
            where = traced.module_of(user) or "the model"
            return SequencePlan(f"{where}: {getattr(user.target, '__name__', user.op)} reads the sequence-split "
                                "stream across positions, and no norm or dropout output (called once) there can "
                                "gather it back")
        if output_of(exit_at)[0] not in plan.exits:
            plan.exits.append(output_of(exit_at)[0])
            stops.add(exit_at)
    walk.run(seeds, stops)  # past an exit, the readers get full sequences
    plan.seq_inputs = sorted(walk.seq_inputs)
    for name in plan.modules:
        if slot_of(traced.calls_of(name)[0].inputs.get(0, rowwise[0])) is None:
            return SequencePlan(f"{name} takes the stream in no positional argument")
    return plan


class _Walk:
    """The stream from its seeds: everything computed per position from them, up to the readers."""

    def __init__(self, traced: TracedForward, readers: dict[torch.fx.Node, str], seq: int):
        self.traced, self.readers, self.seq = traced, readers, seq
        self.returned = set(traced.graph.find_nodes(op="output")[0].args[0][:traced.step.num_fwd_outputs])

    def run(self, seeds: list[torch.fx.Node], stops: set[torch.fx.Node]) -> None:
        self.stream: set[torch.fx.Node] = set(seeds)
        self.pulled: list[torch.fx.Node] = []
        self.leaving: dict[torch.fx.Node, torch.fx.Node] = {}
        self.seq_inputs: set[str] = set()
        self.owners: set[str] = set()
        self.problem = ""
        work = collections.deque(seeds)
        operands: list[tuple[torch.fx.Node, torch.fx.Node]] = []
        parameters = self.traced.parameters

        def add(node: torch.fx.Node) -> None:
            if node not in self.stream:
                self.stream.add(node)
                work.append(node)

        def consume(user: torch.fx.Node) -> None:
            for other in user.all_input_nodes:
                if other in parameters:
                    self.owners.add(parameters[other].rpartition(".")[0])
                elif other not in self.stream:
                    operands.append((other, user))
            add(user)

        while True:
            while work:
                value = work.popleft()
                if value in stops:
                    continue
                for user in value.users:
                    if user in self.stream:
                        continue
                    if user in self.readers:
                        self.seq_inputs.add(self.readers[user])
                    elif user.op == "output":
                        if value in self.returned:
                            self.leaving.setdefault(value, user)
                    elif is_marker(user) or _is_getitem(user):
                        add(user)
                    elif _per_position(user, self.seq):
                        consume(user)
                    else:
                        self.leaving.setdefault(value, user)
            # Operands not computed on the stream join it (a residual from before it) or are broadcast.
            joining = []
            for other, user in operands:
                shape, out_dims = shape_of(other) or (), len(shape_of(user) or ())
                aligned = 1 - (out_dims - len(shape))
                if other in self.stream or other in joining:
                    continue
                if aligned >= 0 and shape[aligned] == self.seq:
                    joining.append(other)
                elif torch.Size(shape).numel() > 1:
                    where = self.traced.module_of(user) or "the model"
                    self.problem = (f"{where}: {user.name} combines the stream with {other.name} {shape}, a "
                                    "replicated tensor that is no module's parameter")
                    return
            if not joining:
                return
            for other in joining:
                if other.op == "call_function" and not is_marker(other) and _per_position(other, self.seq):
                    consume(other)  # computed per position from values before the stream: on it too
                else:
                    self.pulled.append(other)
                    add(other)


def _entry(traced: TracedForward, modules: dict[str, nn.Module], styles: dict[str, str],
           gathers: dict[str, tuple[int | str, int]], value: torch.fx.Node) -> tuple[str, str, torch.fx.Node] | None:
    """Where ``value`` can be cut over the sequence: the innermost module boundary on its way (an embedding
    split over the vocabulary that reduce-scatters, a module's single output, a module's input)."""
    for marker in _chain(value):
        out, slot = output_of(marker), slot_of(marker)
        name = (out or slot)[0]
        calls = traced.calls_of(name)
        if len(calls) != 1 or styles.get(name) in ("colwise", "rowwise"):
            continue
        if out and styles.get(name) == "vocab" and isinstance(modules[name], nn.Embedding):
            return "split", name, marker
        if out and calls[0].arity == 1 and styles.get(name) != "vocab":
            return "output", name, marker
        if slot and name not in gathers and styles.get(name) != "vocab":
            return "input", name, marker
    return None


def _sequence_modules(traced: TracedForward, modules: dict[str, nn.Module], styles: dict[str, str],
                      stream: set[torch.fx.Node], entries: set[str]) -> list[str]:
    """Norms and dropouts (modules with parameters of their own, or ``nn.Dropout``) wholly on the stream."""
    inside = collections.defaultdict(list)
    for node in traced.graph.nodes:
        if node.op == "call_function" and not is_marker(node):
            module = traced.module_of(node)
            while module:
                inside[module].append(node)
                module = module.rpartition(".")[0]
    found = []
    for name, module in modules.items():
        calls = traced.calls_of(name)
        if not calls or name in entries or styles.get(name, "replicate") != "replicate":
            continue
        whole = all(c.inputs.get(0) in stream for c in calls) and all(n in stream for n in inside[name])
        if whole and (isinstance(module, nn.Dropout) or any(True for _ in module.parameters(recurse=False))):
            found.append(name)
    return found
