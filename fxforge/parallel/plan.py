"""A parallel plan: the mesh chosen for a training step, every candidate weighed, and why.

:func:`fxforge.parallelize` returns a :class:`ParallelPlan`. Each :class:`Candidate` is one mesh
(:mod:`fxforge.parallel.strategy`) with its predicted step time (compute + collectives on the link),
per-device memory (weights, gradients, optimizer state and activations, as sharded there) and the bytes of
every collective of a step; a candidate over the memory per device is refused with the figure.

Example:
    >>> c = Candidate({"pp": 1, "dp": 1, "fsdp": 2, "tp": 1}, step_s=0.02, compute_s=0.015, comm_s=0.005,
    ...               memory_per_device=3 * 2**30, comm_bytes=2**20, fits=False,
    ...               reason="needs 3.0 GiB per device, over the 2.0 GiB given")
    >>> c.name, c.row()["memory_per_device_GiB"]
    ('fsdp2', 3.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fxforge.parallel.collectives import Collective
from fxforge.parallel.strategy import name as mesh_name


@dataclasses.dataclass
class Candidate:
    """One mesh, with what it is predicted to cost.

    Attributes:
        strategy: ``{"pp", "dp", "fsdp", "tp"}`` sizes.
        step_s: predicted seconds per training step (``compute_s + comm_s``: no overlap on gloo).
        compute_s: the slowest device's forward, backward and optimizer step.
        comm_s: its collectives on the link (alpha-beta, :mod:`fxforge.core.links`).
        memory_per_device: the predicted peak of a device, bytes.
        comm_bytes: the bytes of every collective a device takes part in per step (full tensors).
        fits: within the memory per device.
        reason: why it is refused, or what it trades, in a sentence.
        collectives: the predicted collectives of one step.
        memory: the peak's parts (weights, gradients, optimizer_state, activations, gathered), bytes.
        partition: for pipeline stages, the :class:`~fxforge.parallel.partition.Partition` they run.
    """

    strategy: dict[str, int]
    step_s: float
    compute_s: float
    comm_s: float
    memory_per_device: int
    comm_bytes: int
    fits: bool
    reason: str = ""
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    partition: Any = dataclasses.field(default=None, repr=False)

    @property
    def name(self) -> str:
        return mesh_name(self.strategy)

    def row(self) -> dict[str, Any]:
        """The candidate as a row of :attr:`ParallelPlan.candidates`."""
        return {"strategy": self.name, "step_s": self.step_s, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "memory_per_device_GiB": round(self.memory_per_device / 2**30, 6),
                "memory_per_device": self.memory_per_device, "comm_bytes": self.comm_bytes, "fits": self.fits,
                "reason": self.reason}


@dataclasses.dataclass
class ParallelPlan:
    """The plan :func:`fxforge.parallelize` returns.

    Attributes:
        strategy: the chosen mesh, e.g. ``{"dp": 1, "fsdp": 2, "tp": 2, "pp": 1}``.
        tp_plan: module name -> ``"colwise" | "rowwise" | "sequence" | "vocab" | "replicate"`` (empty when
            the chosen mesh has no tensor parallelism; :attr:`tp` holds the derived plan either way).
        candidates: a pandas table, one row per mesh: strategy, step_s, memory_per_device, comm_bytes,
            fits, reason; the fastest first among those that fit.
        chosen: the chosen :class:`Candidate`; ``why``: the sentence that says why.
        collectives: the chosen candidate's predicted collectives of one step.
        tp: the derived :class:`~fxforge.parallel.tp_derive.TensorParallelPlan` (None when no degree
            above 1 was possible), its ``reasons`` say what stays replicated.
        link: the link the collectives were costed on.
        options: every candidate, ranked; ``tp_by_degree``: the derived tensor-parallel plan per degree.
        model, loss, optimizer_factory: what :func:`fxforge.parallel.run` runs.
    """

    strategy: dict[str, int]
    tp_plan: dict[str, str]
    candidates: Any
    chosen: Candidate
    why: str
    collectives: list[Collective]
    tp: Any
    link: Any
    model: torch.nn.Module
    loss: Any = None
    optimizer_factory: Any = None
    devices: int = 1
    memory_per_device: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    options: list[Candidate] = dataclasses.field(default_factory=list, repr=False)
    tp_by_degree: dict[int, Any] = dataclasses.field(default_factory=dict, repr=False)

    def choose(self, name: str) -> ParallelPlan:
        """This plan with the candidate ``name`` (``"fsdp2"``, ``"dp2 x tp2"``) chosen instead, to run or compare it.

        Raises:
            KeyError: no such candidate (the message lists them).
        """
        for candidate in self.options:
            if candidate.name == name:
                tp = self.tp_by_degree.get(candidate.strategy["tp"], self.tp)
                tp_plan = dict(tp.styles) if candidate.strategy["tp"] > 1 and tp is not None else {}
                return dataclasses.replace(self, strategy=candidate.strategy, tp_plan=tp_plan, tp=tp, chosen=candidate,
                                           why=f"{name} chosen by hand", collectives=candidate.collectives)
        raise KeyError(f"no candidate {name!r}: the candidates are {', '.join(c.name for c in self.options)}")

    def run(self, example_inputs: Any, steps: int = 1, **options: Any) -> Any:
        """:func:`fxforge.parallel.run` on this plan."""
        from fxforge.parallel.mesh_run import run

        return run(self, example_inputs, steps, **options)

    def __str__(self) -> str:
        cap = f", {self.memory_per_device / 2**30:.2f} GiB each" if self.memory_per_device else ""
        lines = [f"Parallel plan for {self.devices} devices{cap}: {self.chosen.name}", f"  {self.why}",
                 f"  link: {self.link.name} ({self.link.source})" if self.link is not None else ""]
        lines.append("  candidates:")
        for row in self.candidates.itertuples():
            verdict = "fits" if row.fits else "REFUSED"
            lines.append(f"    {row.strategy:<14} step {row.step_s * 1e3:9.2f} ms  memory "
                         f"{row.memory_per_device / 2**20:10.1f} MiB  collectives {row.comm_bytes / 2**20:9.2f} MiB"
                         f"  {verdict}{': ' + row.reason if row.reason else ''}")
        if self.tp is not None and getattr(self.tp, "reasons", None):
            lines.append("  replicated under tensor parallelism:")
            lines += [f"    {name}: {reason}" for name, reason in self.tp.reasons.items()]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(line for line in lines if line)

    def _repr_html_(self) -> str:
        return f"<pre>{self.__str__()}</pre>"
