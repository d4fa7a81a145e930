"""``fxforge.training_memory``: a training step's memory, predicted from its graphs before it runs.

    M = weights + gradients + optimizer state + activations (+ the temporaries of the op running at the peak)

Each term is read from where it lives: weights and buffers from the model; gradients and activations from
AOTAutograd's forward and backward graphs of the step, replayed storage by storage with fake tensors
(:mod:`fxforge.training.timeline`); optimizer state and the optimizer step's temporaries from the
optimizer run on meta tensors (:mod:`fxforge.training.optimizer_memory`). :meth:`TrainingMemory.measure`
runs one real step (:mod:`fxforge.training.measure`) and sets the measured figures beside the predicted
ones, with the error of each.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    >>> tm = training_memory(model, (torch.randn(32, 64),), optimizer=torch.optim.AdamW)
    >>> tm.gradients_bytes, tm.optimizer_state_bytes, tm.activations_bytes
    (16900, 33816, 8192)
    >>> round(abs(float(tm.measure().table.loc["peak", "error_%"])), 1)    # the allocator's records: 12 B more
    0.0
"""

from __future__ import annotations

import dataclasses
import html
from collections import defaultdict
from typing import Any

import torch

from fxforge.capture.model import normalize_inputs
from fxforge.core.memory import tensor_leaves
from fxforge.training.eager_graph import eager_like_graph
from fxforge.training.measure import StepMeasurement, measure_step, unique_bytes
from fxforge.training.optimizer_memory import OptimizerMemory, optimizer_memory
from fxforge.training.step_graph import LossFn, StepGraphs, default_loss, trace_step
from fxforge.training.timeline import StepSimulation, simulate_step

ROWS = ("weights", "buffers", "inputs", "gradients", "optimizer_state", "activations", "temporaries",
        "forward_peak", "backward_peak", "optimizer_peak", "peak")


def _mib(n: float) -> float:
    return round(n / 2**20, 3)


@dataclasses.dataclass
class TrainingMemory:
    """Predicted memory of one training step (steady state: the optimizer's state exists), in bytes.

    Attributes:
        weights_bytes, buffers_bytes, inputs_bytes: alive through the step.
        gradients_bytes: the trainable parameters' gradients (frozen ones have none).
        optimizer_state_bytes: what the optimizer keeps between steps.
        activations_bytes: activations saved for backward (alive from the end of the forward).
        temporaries_bytes: activations alive at the peak that are not saved ones (working values).
        forward_peak_bytes, backward_peak_bytes, optimizer_peak_bytes: each phase's peak, all included.
        peak_bytes: the step's peak; ``peak_phase`` and ``peak_node`` say where.
        step: the traced graphs; ``simulation``: the replay; ``optimizer``: its state and step temporaries.
        measured: the figures of :meth:`measure`, once it has run.

    Example:
        >>> tm = training_memory(torch.nn.Linear(8, 8), (torch.randn(2, 8),), optimizer=None)
        >>> tm.peak_phase, tm.optimizer_state_bytes
        ('backward', 0)
    """

    weights_bytes: int
    buffers_bytes: int
    inputs_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    temporaries_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    peak_bytes: int
    peak_phase: str
    peak_node: str
    step: StepGraphs
    simulation: StepSimulation
    optimizer: OptimizerMemory
    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss: LossFn
    optimizer_factory: Any
    autocast: torch.dtype | None = None
    measured: StepMeasurement | None = None
    modules: Any = None  # the per-module pandas table (see by_module)

    @property
    def persistent_bytes(self) -> int:
        """Weights, buffers, inputs and optimizer state: alive through the whole step."""
        return self.weights_bytes + self.buffers_bytes + self.inputs_bytes + self.optimizer_state_bytes

    def figures(self) -> dict[str, int]:
        """The predicted figures, one per row of :attr:`table`."""
        return {"weights": self.weights_bytes, "buffers": self.buffers_bytes, "inputs": self.inputs_bytes,
                "gradients": self.gradients_bytes, "optimizer_state": self.optimizer_state_bytes,
                "activations": self.activations_bytes, "temporaries": self.temporaries_bytes,
                "forward_peak": self.forward_peak_bytes, "backward_peak": self.backward_peak_bytes,
                "optimizer_peak": self.optimizer_peak_bytes, "peak": self.peak_bytes}

    def measured_figures(self) -> dict[str, int | None]:
        """The measured figures under the names of :meth:`figures` (None for what is not measured apart:
        temporaries); empty before :meth:`measure`.

        Example:
            >>> tm = training_memory(torch.nn.Linear(8, 8), (torch.randn(2, 8),), optimizer=None)
            >>> tm.measured_figures(), tm.measure().measured_figures()["gradients"]
            ({}, 288)
        """
        m = self.measured
        if m is None:
            return {}
        return {"weights": m.weights_bytes, "buffers": m.buffers_bytes, "inputs": m.inputs_bytes,
                "gradients": m.gradient_bytes, "optimizer_state": m.optimizer_state_bytes,
                "activations": m.saved_bytes, "temporaries": None, "forward_peak": m.forward_peak_bytes,
                "backward_peak": m.backward_peak_bytes, "optimizer_peak": m.optimizer_peak_bytes,
                "peak": m.peak_bytes}

    @property
    def table(self):
        """A pandas table, one row per figure: ``predicted_MiB`` and, after :meth:`measure`, ``measured_MiB``
        and ``error_%`` ((predicted - measured) / measured; temporaries are not measured apart)."""
        import pandas as pd

        rows = []
        measured = self.measured_figures()
        for name, value in self.figures().items():
            row = {"figure": name, "predicted_MiB": _mib(value)}
            if self.measured is not None:
                got = measured.get(name)
                row["measured_MiB"] = _mib(got) if got is not None else None
                row["error_%"] = (round(100.0 * (value - got) / got, 2) if got else (0.0 if got == value else None)) \
                    if got is not None else None
            rows.append(row)
        return pd.DataFrame(rows).set_index("figure")

    def by_module(self, depth: int | None = 1):
        """Per module: weights, gradients, optimizer state and saved activations (MiB), one row per module
        name cut to ``depth`` dots (None: the innermost modules), sorted by total.

        Example:
            >>> tm = training_memory(torch.nn.Sequential(torch.nn.Linear(8, 8)), (torch.randn(2, 8),))
            >>> list(tm.by_module().index)
            ['0']
        """
        frame = self.modules.copy()
        if depth is not None:
            frame.index = [".".join(name.split(".")[:depth]) if name else "(root)" for name in frame.index]
            frame = frame.groupby(level=0).sum()
        frame["total_MiB"] = frame.sum(axis=1)
        return frame.sort_values("total_MiB", ascending=False)

    def measure(self) -> TrainingMemory:
        """Run one real step (see :func:`fxforge.training.measure.measure_step`) and keep its figures in
        :attr:`measured`; :attr:`table` then shows both and the error. Returns self.

        Example:
            >>> tm = training_memory(torch.nn.Linear(8, 8), (torch.randn(2, 8),), optimizer=None)
            >>> tm.measure().measured.gradient_bytes == tm.gradients_bytes
            True
        """
        self.measured = measure_step(self.model, self.args, self.kwargs, loss=self.loss,
                                     optimizer=self.optimizer_factory, autocast=self.autocast)
        return self

    def plot(self, ax: Any = None) -> Any:
        """Live bytes through forward and backward (activations and gradients stacked, the persistent bytes
        under them), the optimizer step's peak after them, the measured peak as a line when measured."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(9, 3.5))
        sim = self.simulation
        steps = range(len(sim.nodes))
        base = [self.persistent_bytes / 2**20] * len(sim.nodes)
        grads = [b + g / 2**20 for b, g in zip(base, sim.gradients)]
        acts = [g + a / 2**20 for g, a in zip(grads, sim.activations)]
        ax.fill_between(steps, 0, base, label="weights, buffers, inputs, optimizer state", color="#bbbbbb")
        ax.fill_between(steps, base, grads, label="gradients", color="#7fa7d9")
        ax.fill_between(steps, grads, acts, label="activations", color="#f2a65a")
        ax.axhline(self.optimizer_peak_bytes / 2**20, color="#555555", ls=":", label="optimizer step peak")
        if self.measured is not None:
            ax.axhline(self.measured.peak_bytes / 2**20, color="#c0392b", ls="--", label="measured peak")
        backward_start = next((i for i, (phase, _) in enumerate(sim.nodes) if phase == "backward"), None)
        if backward_start is not None:
            ax.axvline(backward_start, color="black", lw=0.8)
        ax.set_xlabel("node (forward | backward)")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left", fontsize=8)
        return ax

    def _repr_html_(self) -> str:
        table = self.table.to_html()
        where = html.escape(f"peak in the {self.peak_phase} at {self.peak_node}")
        return f"<div><b>Training step memory</b> ({where})</div>{table}"

    def __repr__(self) -> str:
        return (f"TrainingMemory(peak={_mib(self.peak_bytes)} MiB in the {self.peak_phase}, weights="
                f"{_mib(self.weights_bytes)}, gradients={_mib(self.gradients_bytes)}, optimizer_state="
                f"{_mib(self.optimizer_state_bytes)}, activations={_mib(self.activations_bytes)} MiB)")


def _module_table(model: torch.nn.Module, step: StepGraphs, sim: StepSimulation, opt: OptimizerMemory):
    import pandas as pd

    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    owners = {}
    for name, _ in model.named_parameters():
        owners[name] = name.rsplit(".", 1)[0] if "." in name else ""
    trainable = [p for p in model.parameters()]
    state = dict(zip([n for n, _ in model.named_parameters()], opt.state_by_param))
    seen: set[int] = set()
    for (name, p) in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        row = rows[owners[name]]
        nbytes = p.numel() * p.element_size()
        row["weights_MiB"] += nbytes / 2**20
        row["gradients_MiB"] += nbytes / 2**20 if p.requires_grad else 0.0
        row["optimizer_state_MiB"] += state.get(name, 0) / 2**20
    for module, nbytes in sim.saved_by_module.items():
        rows[module]["activations_MiB"] += nbytes / 2**20
    del trainable
    frame = pd.DataFrame.from_dict({k: dict(v) for k, v in rows.items()}, orient="index").fillna(0.0)
    for column in ("weights_MiB", "gradients_MiB", "optimizer_state_MiB", "activations_MiB"):
        if column not in frame:
            frame[column] = 0.0
    return frame[["weights_MiB", "gradients_MiB", "optimizer_state_MiB", "activations_MiB"]]


def training_memory(model: torch.nn.Module, example_inputs: Any, optimizer: Any = torch.optim.AdamW,
                    loss: LossFn | None = None, *, autocast: torch.dtype | None = None) -> TrainingMemory:
    """Predict the memory of one training step of ``model`` on ``example_inputs``, without running it.

    The step is ``loss(model(*inputs)).backward(); optimizer.step(); optimizer.zero_grad()`` in the model's
    current mode, in its steady state (the optimizer's state exists, as from the second step on).

    Args:
        model: the model (train mode for dropout and batch-norm statistics, as the step would run).
        example_inputs: a tuple, one tensor, or a dict of keyword inputs (a batch of the real size).
        optimizer: an optimizer class (``torch.optim.AdamW``), a factory ``params -> optimizer``, a name
            (``"adamw"``, ``"sgd"``...), or None for no optimizer.
        loss: outputs -> scalar loss; default the sum of the floating-point outputs.
        autocast: a dtype (``torch.bfloat16``) to run the forward under ``torch.autocast``, as mixed
            precision training does.

    Example:
        >>> tm = training_memory(torch.nn.Linear(1024, 1024), (torch.randn(8, 1024),), optimizer="sgd")
        >>> round(tm.optimizer_state_bytes / 2**20, 2)     # SGD with momentum: one buffer per parameter
        4.0
    """
    args, kwargs = normalize_inputs(example_inputs)
    loss = loss or default_loss
    graph_module = eager_like_graph(model, example_inputs)
    step = trace_step(graph_module, args, kwargs, loss=loss, autocast=autocast)
    sim = simulate_step(step, eager_dropout=True, eager_backward=True)
    params = list(dict.fromkeys(model.parameters()))
    opt = optimizer_memory(optimizer, params)
    weights = unique_bytes(model.parameters())
    buffers = unique_bytes(model.buffers())
    inputs = unique_bytes(tensor_leaves((args, kwargs)))
    persistent = weights + buffers + inputs + opt.state_bytes
    forward_peak = persistent + max((a + g for (phase, _), a, g in zip(sim.nodes, sim.activations, sim.gradients)
                                     if phase == "forward"), default=0)
    backward_peak = persistent + max((a + g for (phase, _), a, g in zip(sim.nodes, sim.activations, sim.gradients)
                                      if phase == "backward"), default=0)
    # The optimizer steps with the gradients (and the loss the caller holds) alive.
    optimizer_peak = persistent + sim.gradient_bytes + sim.output_bytes + opt.step_peak_bytes
    peaks = {"forward": forward_peak, "backward": backward_peak, "optimizer": optimizer_peak}
    phase = max(peaks, key=peaks.get)
    node = "optimizer.step"
    if phase != "optimizer":
        in_phase = [i for i, (name, _) in enumerate(sim.nodes) if name == phase]
        node = sim.nodes[max(in_phase, key=lambda i: sim.activations[i] + sim.gradients[i])][1]
    tm = TrainingMemory(weights, buffers, inputs, sim.gradient_bytes, opt.state_bytes, sim.saved_bytes,
                        sim.temporaries_at_peak(), forward_peak, backward_peak, optimizer_peak, peaks[phase],
                        phase, node, step, sim, opt, model, args, kwargs, loss, optimizer, autocast)
    tm.modules = _module_table(model, step, sim, opt)
    return tm
