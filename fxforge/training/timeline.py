"""Live bytes through a training step's forward and backward graphs, storage by storage.

The same rule as :mod:`fxforge.core.memory` (a value is freed after its last use; views and aliases share
their storage; parameters and inputs are not allocated by the step), carried across the two graphs of a
:class:`~fxforge.training.step_graph.StepGraphs`:

- the forward allocates activations; those it returns (the values saved for backward, the loss or the
  model's outputs) stay alive into the backward;
- the backward starts with the saved values and the tangents alive, frees each saved value after its last
  use, and allocates the parameters' gradients, which stay alive (until the optimizer has used them);
- every storage carries a category: ``activations`` (saved for backward or not, gradients of activations,
  values the backward recomputes) or ``gradients`` (of parameters), and the name of the module whose node
  allocated it.

Storages are identified through the fake tensors on the nodes (``meta["val"]``): AOTAutograd gives a saved
value the same fake tensor in both graphs, so the backward's placeholders are the forward's storages.

Example:
    >>> from fxforge.training.step_graph import trace_step
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    >>> sim = simulate_step(trace_step(model, (torch.randn(32, 64),), {}))
    >>> sim.saved_bytes, sim.gradient_bytes             # relu's output, and 64*64 + 64 + 64 + 1 floats
    (8192, 16900)
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch

from fxforge.core.memory import scratch_bytes, tensor_leaves
from fxforge.core.symbolic import hint
from fxforge.training.step_graph import StepGraphs, module_of


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = tensor.untyped_storage()
        return storage._cdata, hint(storage.nbytes())
    except Exception:  # noqa: BLE001 - no storage to account (sparse, opaque)
        return None


@dataclasses.dataclass
class Storage:
    """One storage of the step: its bytes, what it holds and the module whose node allocated it."""

    nbytes: int
    category: str  # "activations", "gradients", or "external" (parameters, buffers, inputs: not the step's)
    module: str = ""
    saved: bool = False  # an activation the forward returns to the backward


@dataclasses.dataclass
class StepSimulation:
    """The simulated forward+backward of a step.

    Attributes:
        nodes: ``(phase, node name)`` in execution order, phase ``"forward"`` or ``"backward"``.
        activations: live activation bytes while each node runs (its inputs, its result, its scratch).
        gradients: live parameter-gradient bytes at each node.
        peak_bytes: the largest ``activations + gradients``.
        peak_index: where it is reached (an index into ``nodes``).
        activation_peak_bytes: the largest ``activations`` alone (what checkpointing can lower).
        saved_bytes: bytes saved for backward (alive between the two graphs, the outputs aside).
        output_bytes: the forward's own outputs (the loss, or the model's outputs).
        gradient_bytes: parameter gradients at the end.
        storages: every storage the step allocates.
        saved_by_module: saved bytes per module that allocated them.

    Example:
        >>> StepSimulation([("forward", "a")], [4], [0], 4, 0, 4, 4, 0, 0, [], {}).peak_phase
        'forward'
    """

    nodes: list[tuple[str, str]]
    activations: list[int]
    gradients: list[int]
    peak_bytes: int
    peak_index: int
    activation_peak_bytes: int
    saved_bytes: int
    output_bytes: int
    gradient_bytes: int
    storages: list[Storage]
    saved_by_module: dict[str, int]

    @property
    def peak_phase(self) -> str:
        """``"forward"`` or ``"backward"``: where the step's peak falls."""
        return self.nodes[self.peak_index][0] if self.nodes else "forward"

    @property
    def peak_node(self) -> str:
        """The node running at the peak."""
        return self.nodes[self.peak_index][1] if self.nodes else ""

    def temporaries_at_peak(self) -> int:
        """Activation bytes alive at the peak that are not saved for backward (the ops' working values)."""
        return max(0, self.activations[self.peak_index] - self._saved_live_at_peak) if self.nodes else 0

    _saved_live_at_peak: int = 0


class _Phase:
    """Storage bookkeeping for one graph: which storages each node allocates, holds and touches."""

    def __init__(self, graph_module: torch.fx.GraphModule, storages: list[Storage], known: dict[int, int],
                 keys: dict[int, int], eager_dropout: bool = False):
        self.keys = keys  # storage id -> its fake storage's identity, shared by both graphs
        self.nodes = [n for n in graph_module.graph.nodes if n.op != "output"]
        (out,) = graph_module.graph.find_nodes(op="output")
        self.refs: dict[torch.fx.Node, list[int]] = {}
        self.allocs: dict[torch.fx.Node, list[int]] = {}
        self.scratch: dict[torch.fx.Node, int] = {}
        for node in self.nodes:
            inputs = {s for i in node.all_input_nodes for s in self.refs.get(i, ())}
            refs: list[int] = []
            allocs: list[int] = []
            local: dict[int, int] = {}
            widened = eager_dropout and _is_cpu_dropout(node)
            for position, leaf in enumerate(tensor_leaves(node.meta.get("val"))):
                found = _storage(leaf)
                if found is None:
                    continue
                key, nbytes = found
                if widened and position == 1:
                    nbytes *= node.meta["val"][0].element_size()  # eager CPU keeps a mask of the input's dtype
                sid = known.get(key) if node.op == "placeholder" else local.get(key)
                if sid is None and node.op != "placeholder":
                    sid = next((s for s in inputs if self._key(s) == key), None)
                if sid is None:
                    category = "external" if node.op in ("placeholder", "get_attr") else "activations"
                    storages.append(Storage(nbytes, category, module_of(node)))
                    sid = len(storages) - 1
                    self.keys[sid] = key
                    if category != "external":
                        allocs.append(sid)
                local[key] = sid
                if sid not in refs:
                    refs.append(sid)
            self.refs[node] = refs
            self.allocs[node] = allocs
            self.scratch[node] = scratch_bytes(node, graph_module) if node.op == "call_function" else 0
        self.outputs = [a if isinstance(a, torch.fx.Node) else None for a in out.args[0]]

    def _key(self, sid: int) -> int | None:
        return self.keys.get(sid)

    def touches(self, node: torch.fx.Node) -> set[int]:
        return {*self.refs[node], *(s for i in node.all_input_nodes for s in self.refs.get(i, ()))}


def _is_cpu_dropout(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return (node.op == "call_function" and node.target is torch.ops.aten.native_dropout.default
            and isinstance(value, (tuple, list)) and value[0].device.type == "cpu")


def simulate_step(step: StepGraphs, *, eager_dropout: bool = False, eager_backward: bool = False,
                  loss_bytes: int | None = None) -> StepSimulation:
    """Replay the step's forward then backward graph and follow every storage it allocates.

    ``eager_dropout``: count the ``native_dropout`` nodes left in the graph as eager runs them on CPU.
    AOTAutograd decomposes the dropout inside an op (SDPA's math path) into ``native_dropout``, whose mask is
    bool; eager's CPU kernel keeps a noise tensor of the input's dtype for the backward instead, 4 bytes per
    element in float32 (the plain dropouts of a model already compute eager's way: see
    :mod:`fxforge.training.eager_graph`). The prediction of an eager step sets it; a step fxforge runs from
    the graphs does not.

    ``eager_backward``: free the backward's values as eager's autograd engine does: one autograd node's
    formula (the ops of one forward op's ``seq_nr``) keeps every value it computed until it returns, where
    a graph frees each after its last use (``pow``'s backward holds ``x ** (n - 1)`` and two products).

    ``loss_bytes``: what the caller's loss allocates at most in its own forward and backward, which run
    between the two graphs (a step traced without its loss): one more sample at the start of the backward,
    with everything the forward left alive but the outputs, which the loss's figure counts for as long as it
    holds them (it saves what its backward needs); the backward graph starts without them. None (the loss is not known): the
    outputs stay alive to the end, as if the caller held them.

    Example:
        >>> from fxforge.training.step_graph import trace_step
        >>> sim = simulate_step(trace_step(torch.nn.Linear(256, 256), (torch.randn(64, 256),), {}))
        >>> sim.saved_bytes, sim.peak_phase            # a linear layer saves nothing but its input
        (0, 'backward')
    """
    storages: list[Storage] = []
    keys: dict[int, int] = {}
    forward = _Phase(step.forward, storages, {}, keys, eager_dropout)
    fw_outputs = forward.outputs
    own, saved = fw_outputs[:step.num_fwd_outputs], fw_outputs[step.num_fwd_outputs:]
    pinned_fw = {s for n in fw_outputs if n is not None for s in forward.refs[n]}
    for node in saved:
        for sid in forward.refs.get(node, ()) if node is not None else ():
            if storages[sid].category == "activations":
                storages[sid].saved = True
    for node in own:
        for sid in forward.refs.get(node, ()) if node is not None else ():
            if storages[sid].category == "activations":
                storages[sid].saved = False
    # The backward's placeholders: the saved values (the forward's storages), then the tangents.
    keys_to_sid = {keys[s]: s for s in pinned_fw if s in keys}
    backward = _Phase(step.backward, storages, keys_to_sid, keys)
    tangents = [n for n in backward.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    for node in tangents:
        for sid in backward.refs[node]:
            if storages[sid].category == "external":
                storages[sid].category = "activations"
    gradient_storages: set[int] = set()
    for node in backward.outputs[:len(step.parameter_names)]:
        if node is not None:
            for sid in backward.refs[node]:
                if storages[sid].category == "activations":
                    storages[sid].category = "gradients"
                    gradient_storages.add(sid)

    nodes: list[tuple[str, str]] = []
    acts: list[int] = []
    grads: list[int] = []
    live = defaultdict(int)
    alive: set[int] = set()
    saved_live: list[int] = []

    def run(phase: _Phase, name: str, pinned: set[int], initial: list[int], grouped: bool = False) -> None:
        for sid in initial:
            if sid not in alive:
                alive.add(sid)
                live[storages[sid].category] += storages[sid].nbytes
        remaining: dict[int, int] = defaultdict(int)
        for node in phase.nodes:
            for sid in phase.touches(node):
                remaining[sid] += 1
        pending: list[int] = []
        for position, node in enumerate(phase.nodes):
            group = node.meta.get("seq_nr") if grouped else None
            for sid in phase.allocs[node]:
                if sid not in alive:
                    alive.add(sid)
                    live[storages[sid].category] += storages[sid].nbytes
            nodes.append((name, node.name))
            acts.append(live["activations"] + phase.scratch[node])
            grads.append(live["gradients"])
            saved_live.append(sum(storages[s].nbytes for s in alive if storages[s].saved))
            following = phase.nodes[position + 1].meta.get("seq_nr") if grouped and position + 1 < len(
                phase.nodes) else None
            for sid in phase.touches(node):
                remaining[sid] -= 1
                if remaining[sid] == 0 and sid not in pinned and sid in alive:
                    pending.append(sid)
            # Eager's backward formula keeps what it computed, its gradient inputs and its saved values until
            # it returns: a value last used inside one autograd node (one forward op's seq_nr) is freed when
            # that node's last op has run.
            for sid in [s for s in pending if group is None or following != group]:
                pending.remove(sid)
                alive.discard(sid)
                live[storages[sid].category] -= storages[sid].nbytes

    run(forward, "forward", pinned_fw, [])
    saved_bytes = sum(storages[s].nbytes for s in alive if storages[s].saved)
    output_sids = {s for n in own if n is not None for s in forward.refs[n] if storages[s].category == "activations"}
    output_bytes = sum(storages[s].nbytes for s in output_sids)
    # The outputs (loss) stay alive through the backward, held by the caller.
    tangent_sids = [s for n in tangents for s in backward.refs[n]]
    held = output_sids
    if loss_bytes is not None:  # the loss holds the outputs from here (its figure counts them)
        held = set()
        for sid in output_sids:
            if sid in alive and not storages[sid].saved:
                alive.discard(sid)
                live[storages[sid].category] -= storages[sid].nbytes
        nodes.append(("backward", "loss.backward"))
        acts.append(live["activations"] + loss_bytes)
        grads.append(live["gradients"])
        saved_live.append(saved_bytes)
    run(backward, "backward", held | gradient_storages, tangent_sids, grouped=eager_backward)
    totals = [a + g for a, g in zip(acts, grads)]
    peak_index = max(range(len(totals)), key=totals.__getitem__) if totals else 0
    saved_by_module: dict[str, int] = defaultdict(int)
    for s in storages:
        if s.saved:
            saved_by_module[s.module] += s.nbytes
    sim = StepSimulation(nodes, acts, grads, totals[peak_index] if totals else 0, peak_index,
                         max(acts, default=0), saved_bytes, output_bytes,
                         sum(storages[s].nbytes for s in gradient_storages), storages, dict(saved_by_module))
    sim._saved_live_at_peak = saved_live[peak_index] if saved_live else 0
    return sim


def describe(sim: StepSimulation) -> dict[str, Any]:
    """The simulation's headline figures as a dict (for reports and tables)."""
    return {"peak_bytes": sim.peak_bytes, "peak_phase": sim.peak_phase, "peak_node": sim.peak_node,
            "saved_bytes": sim.saved_bytes, "activation_peak_bytes": sim.activation_peak_bytes,
            "gradient_bytes": sim.gradient_bytes}
