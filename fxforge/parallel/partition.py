"""``fxforge.partition``: cost-balanced pipeline stages, and this rank's stage on PyTorch's engine.

The model's training step is traced on one microbatch (:mod:`fxforge.parallel.units`), the places a
stage may begin are the submodules called once, and a dynamic program picks the ``k - 1`` of them that
minimise the slowest stage (forward + backward + what it sends), every stage within
``memory_per_stage`` (:mod:`fxforge.parallel.split`). The result gives ``split_spec`` in the form
``torch.distributed.pipelining.pipeline()`` takes, the per-stage figures, the simulated step of the 1F1B
and GPipe schedules (:mod:`fxforge.parallel.simulate`), and :meth:`Partition.build_stage`. Split points
that PyTorch's engine cannot build or run are refused and searched around (:mod:`fxforge.parallel.engine`).

Example:
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    >>> part = partition(model, (torch.randn(8, 64),), stages=2, microbatches=4)
    >>> part.split_spec
    {'3': <SplitPoint.BEGINNING: 1>}
"""

from __future__ import annotations

import dataclasses
import functools
import html
import itertools
import math
from typing import Any

import torch

from fxforge.core.costs import Machine
from fxforge.core.nodes import named_submodule
from fxforge.core.units import parse_budget
from fxforge.parallel.columns import column_plans
from fxforge.parallel.engine import _engine_split, _spec, build_pipe
from fxforge.parallel.restructure import pipeline_ready
from fxforge.parallel.simulate import SimulatedPipeline, simulate_pipeline
from fxforge.parallel.split import (
    SCHEDULES,
    StageTables,
    best_split,
    even_layer_split,
    in_flight,
    parameter_split,
)
from fxforge.parallel.units import StageUnits, stage_units

POLICIES = ("fxforge", "even-layers", "parameters")
"""How the split points are chosen: fxforge's balance of costs, torchtitan's even split of the blocks, or
PiPPy's old even split of the parameter bytes."""

BLOCKS_GAIN = 0.99
"""Column blocks are kept only when they make the slowest stage at least this much faster (a factor)."""

LINK_GBS = 12.5
"""The default link between stages, GB/s (100 Gbit/s)."""


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


@dataclasses.dataclass
class Partition:
    """Where each pipeline stage begins, what each costs and holds, and how a step would run.

    Attributes:
        stages, microbatches, schedule: the pipeline planned for (the schedule sets the memory in flight).
        policy: how the split points were chosen (:data:`POLICIES`).
        split_points: the submodules stages 1..k-1 begin with.
        stage_forward_seconds, stage_backward_seconds: per stage, per microbatch (roofline estimates).
        stage_costs: per stage, forward + backward + the time to send its activations and gradients.
        stage_memory: per stage, bytes at its peak: weights, their gradients, and the activations of the
            microbatches it holds at once (saved ones and those received).
        transfer_bytes: per boundary between stage s and s + 1, activation bytes crossing it per
            microbatch (a skip connection counts at every boundary it crosses; gradients flow back the same).
        memory_per_stage: the cap the split was chosen under (bytes), or None.
        units: the traced chain of units the split was made on.
        refused: split points a stage could not begin at on torch's engine, with the error (a stage that
            changes a received tensor in place: ``out += identity`` right after the split).
        column_blocks: the ``Linear`` layers computed in blocks of output features so that stages can share
            them (:mod:`fxforge.parallel.columns`), with their number of blocks; empty when none is.
        pipeline_model: the model the split points name, as torch's engine runs it: the model itself, or a
            new root sharing its parameters where submodules had to be replaced (column blocks, and
            ``torch.no_grad()`` submodules the engine cannot split around;
            :func:`~fxforge.parallel.restructure.pipeline_ready`).
    """

    model: torch.nn.Module
    stages: int
    microbatches: int
    schedule: str
    policy: str
    split_points: list[str]
    cuts: list[int]
    stage_forward_seconds: list[float]
    stage_backward_seconds: list[float]
    stage_costs: list[float]
    stage_memory: list[int]
    transfer_bytes: list[int]
    memory_per_stage: float | None
    units: StageUnits
    link_gbs: float
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    column_blocks: dict[str, int] = dataclasses.field(default_factory=dict)
    pipeline_model: Any = dataclasses.field(default=None, repr=False)
    _pipe: Any = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.pipeline_model is None:
            self.pipeline_model = self.model

    @property
    def split_spec(self) -> dict[str, Any]:
        """``{submodule: SplitPoint.BEGINNING}`` for ``torch.distributed.pipelining.pipeline()`` of
        :attr:`pipeline_model` (the model itself unless submodules had to be replaced)."""
        return _spec(self.split_points)

    @property
    def bottleneck_ratio(self) -> float:
        """The slowest stage's cost over the mean stage's (1.0 is perfect balance)."""
        return max(self.stage_costs) / (sum(self.stage_costs) / len(self.stage_costs))

    @property
    def floor_ratio(self) -> float:
        """The largest unit's time over the mean stage's: no split at these split points has a bottleneck
        ratio below it (a GPT-2 LM head over a 50k vocabulary is one unit: a quarter of the model's time)."""
        return float(self.units.seconds.max()) / (sum(self.stage_costs) / len(self.stage_costs))

    @property
    def microbatch_size(self) -> int:
        leaves = [t for t in (*self.units.microbatch[0], *self.units.microbatch[1].values())
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        return int(leaves[0].shape[0]) if leaves else 1

    def simulate(self, schedule: str | None = None) -> SimulatedPipeline:
        """One step of ``schedule`` (default: the partition's) with these stages, simulated."""
        send_forward = [b / (self.link_gbs * 1e9) for b in self.transfer_bytes] + [0.0]
        send_backward = [0.0] + send_forward[:-1]
        return simulate_pipeline(self.stage_forward_seconds, self.stage_backward_seconds,
                                 microbatches=self.microbatches, schedule=schedule or self.schedule,
                                 send_forward=send_forward, send_backward=send_backward,
                                 microbatch_size=self.microbatch_size)

    @property
    def throughput(self) -> dict[str, float]:
        """Simulated samples per second under each schedule."""
        return {name: self.simulate(name).throughput for name in SCHEDULES}

    def table(self) -> Any:
        """One row per stage (pandas): where it begins, its time, memory and what it sends on."""
        import pandas as pd

        rows = []
        for s in range(self.stages):
            rows.append({"stage": s, "begins_at": (["(model start)"] + self.split_points)[s],
                         "units": self._edges()[s + 1] - self._edges()[s],
                         "forward_ms": self.stage_forward_seconds[s] * 1e3,
                         "backward_ms": self.stage_backward_seconds[s] * 1e3,
                         "cost_ms": self.stage_costs[s] * 1e3, "memory_mib": self.stage_memory[s] / 2**20,
                         "sends_mib": (self.transfer_bytes[s] / 2**20) if s < self.stages - 1 else 0.0})
        return pd.DataFrame(rows)

    def _edges(self) -> list[int]:
        return [0, *self.cuts, len(self.units)]

    def pipe(self) -> Any:
        """The model split by ``torch.distributed.pipelining.pipeline()`` at :attr:`split_spec` (traced
        with ``torch.export`` on one microbatch; built once) of :attr:`pipeline_model`. The model itself is
        left as it was."""
        if self._pipe is None:
            self._pipe = build_pipe(self.pipeline_model, self.units.microbatch, self.split_spec, self.stages)
        return self._pipe

    def build_stage(self, rank: int, device: Any, group: Any = None) -> Any:
        """This rank's ``torch.distributed.pipelining`` stage (``_PipelineStage``), ready for a schedule
        (``Schedule1F1B(stage, n_microbatches=part.microbatches, loss_fn=...)``).

        Example (in each of ``k`` processes of an initialised process group)::

            stage = part.build_stage(dist.get_rank(), torch.device("cpu"))
            schedule = Schedule1F1B(stage, part.microbatches, loss_fn=loss_fn)
        """
        if not 0 <= rank < self.stages:
            raise ValueError(f"rank {rank} has no stage: the partition has stages 0..{self.stages - 1}")
        return self.pipe().build_stage(rank, torch.device(device), group)

    def __str__(self) -> str:
        lines = [(f"Partition into {self.stages} stages ({self.policy}), {self.microbatches} microbatches, "
                  f"{self.schedule}: bottleneck ratio {self.bottleneck_ratio:.3f} (the largest unit alone: "
                  f"{self.floor_ratio:.3f})")]
        for s in range(self.stages):
            begins = (["(model start)"] + self.split_points)[s]
            sends = f", sends {_mib(self.transfer_bytes[s])}" if s < self.stages - 1 else ""
            lines.append(f"  stage {s}: from {begins}: forward {_ms(self.stage_forward_seconds[s])} + backward "
                         f"{_ms(self.stage_backward_seconds[s])} = {_ms(self.stage_costs[s])} per microbatch, "
                         f"memory {_mib(self.stage_memory[s])}{sends}")
        for name, sim in ((n, self.simulate(n)) for n in SCHEDULES):
            lines.append(f"  {name}: step {_ms(sim.makespan)}, {sim.throughput:.1f} samples/s, "
                         f"bubble {sim.bubble:.0%}")
        for name, count in self.column_blocks.items():
            lines.append(f"  {name} (Linear) computed in {count} blocks of its output features, so that stages "
                         f"can share it: {name}.blocks.0 .. {name}.blocks.{count - 1}")
        if self.memory_per_stage is not None:
            lines.append(f"  memory cap per stage: {_mib(self.memory_per_stage)}")
        for name, reason in self.refused.items():
            lines.append(f"  refused to begin a stage at {name}: {reason}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = html.escape(str(self).splitlines()[0])
        return f"<p><b>{head}</b></p>" + self.table().to_html(index=False, float_format=lambda v: f"{v:.3f}")


def _figures(tables: StageTables, units: StageUnits, cuts: list[int], stages: int, microbatches: int,
             schedule: str) -> tuple[list[float], list[float], list[float], list[int], list[int]]:
    edges = [0, *cuts, len(units)]
    time = tables.time_table()
    spans = list(itertools.pairwise(edges))
    forward = [float(tables.forward[a, b]) for a, b in spans]
    backward = [float(tables.backward[a, b]) for a, b in spans]
    costs = [float(time[a, b]) for a, b in spans]
    memory = [int(tables.memory_table(in_flight(schedule, s, stages, microbatches))[a, b])
              for s, (a, b) in enumerate(spans)]
    crossing = [sum(v.nbytes for v in units.values if v.unit < edge <= v.uses[-1]) for edge in edges[1:-1]]
    return forward, backward, costs, memory, crossing


def partition(model: torch.nn.Module, example_inputs: Any, stages: int, *, memory_per_stage: Any = None,
              microbatches: int | None = None, schedule: str = "1F1B", link_gbs: float = LINK_GBS,
              machine: Machine | None = None, policy: str = "fxforge", units: StageUnits | None = None,
              validate: bool = True, costs: str = "roofline", column_blocks: bool = True) -> Partition:
    """Split ``model`` into ``stages`` pipeline stages that balance forward + backward time.

    Args:
        model: the model to pipeline (left as it is).
        example_inputs: one whole batch (tuple, tensor, or dict of keywords); sliced into ``microbatches``
            along dim 0 as the schedule will.
        stages: how many stages.
        memory_per_stage: bytes (or ``"2GiB"``) each stage may hold at its peak; None for no cap.
        microbatches: microbatches per step (default: one per stage, the fewest 1F1B runs with).
        schedule: ``"1F1B"`` or ``"GPipe"``: how many microbatches' activations a stage holds at once.
        link_gbs: bandwidth between stages, GB/s, for the cost of sending activations and gradients.
        machine: the device the costs are estimated for (default: this machine's CPU, measured once).
        policy: ``"fxforge"`` (balance costs), ``"even-layers"`` or ``"parameters"`` (the peers' splits,
            for comparison).
        units: the traced units, when already traced (to compare policies without tracing again).
        costs: ``"roofline"`` (FLOPs and bytes on the measured machine; the default, deterministic) or
            ``"measured"`` (every node of the step timed on one microbatch, this process's threads).
        validate: build the stages with ``torch.distributed.pipelining`` and run one microbatch through
            them in this process (a forward with real data); a split point where a stage fails is refused
            (:attr:`Partition.refused`) and the search runs again without it. fxforge's policy only.
        column_blocks: where a ``Linear`` layer alone takes more than a mean stage (an LM head over a large
            vocabulary), also plan the model with that layer computed in blocks of its output features
            (:mod:`fxforge.parallel.columns`; blocks of 1/2, 1/4 and 1/6 of a mean stage are tried), and
            keep the best of those plans when its slowest stage is at least 1 % faster. fxforge's policy
            only; the split points then name :attr:`Partition.pipeline_model`.

    Raises:
        ValueError: bad arguments, a model with fewer split points than stages, a cap no split fits (with
            the least cap that would), or a peer's policy the model has no blocks for.

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
        >>> part = partition(model, (torch.randn(4, 32),), stages=2, microbatches=2)
        >>> part.split_points, part.bottleneck_ratio < 1.2
        (['2'], True)
    """
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive int, got {stages!r}")
    microbatches = stages if microbatches is None else microbatches
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    if schedule == "1F1B" and microbatches < stages:
        raise ValueError(f"1F1B needs at least as many microbatches as stages ({microbatches} < {stages}): "
                         "give more microbatches, or schedule='GPipe'")
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {', '.join(POLICIES)}")
    cap = None
    if memory_per_stage is not None:
        kind, cap = parse_budget(memory_per_stage)
        if kind != "bytes":
            raise ValueError(f"memory_per_stage {memory_per_stage!r}: give bytes (an int or '2GiB')")
    ready = pipeline_ready(model)
    if units is not None and not all(named_submodule(ready, name) is not None for name in units.names):
        raise ValueError("the units given were traced on another model: a Partition with column blocks has the "
                         "units of its pipeline_model; pass those traced on this model (stage_units)")
    units = units or stage_units(ready, example_inputs, microbatches=microbatches, machine=machine, costs=costs)
    tables = StageTables.of_units(units, link_gbs)
    refused: dict[str, str] = {}
    pipe = None
    pipeline_model, blocks = ready, {}
    if policy == "fxforge":
        def best(tables: StageTables, forbidden: frozenset[int] = frozenset()) -> list[int]:
            return best_split(tables, stages, memory_per_stage=cap, microbatches=microbatches, schedule=schedule,
                              forbidden=forbidden)

        if column_blocks:
            slowest = BLOCKS_GAIN * _slowest(tables, best)
            for plan in column_plans(ready, units.names, units.seconds, stages):
                blocked = pipeline_ready(model, plan)
                blocked_units = stage_units(blocked, units.microbatch[1] or units.microbatch[0],
                                            machine=units.machine, costs=costs)   # the same microbatch
                blocked_tables = StageTables.of_units(blocked_units, link_gbs)
                if (candidate := _slowest(blocked_tables, best)) < slowest:
                    slowest, pipeline_model, blocks, units, tables = (candidate, blocked, plan, blocked_units,
                                                                      blocked_tables)
        search = functools.partial(best, tables)
        if validate:
            cuts, refused, pipe = _engine_split(pipeline_model, units, stages, search)
        else:
            cuts = search(frozenset())
    elif policy == "even-layers":
        cuts = even_layer_split(units.names, model, stages)
    else:
        cuts = parameter_split(units, stages)
    if cuts is None:
        raise ValueError(f"the {policy} split has no {stages} non-empty stages for this model")
    forward, backward, costs, memory, crossing = _figures(tables, units, cuts, stages, microbatches, schedule)
    if cap is not None and max(memory) > cap and policy == "fxforge":  # best_split guarantees it
        raise AssertionError("the chosen split exceeds the memory cap")
    return Partition(model, stages, microbatches, schedule, policy, [units.names[c] for c in cuts], list(cuts),
                     forward, backward, costs, memory, crossing, cap, units, link_gbs, refused, blocks,
                     pipeline_model, pipe)


def _slowest(tables: StageTables, best: Any) -> float:
    """The slowest stage of ``best(tables)``'s split (infinite when no split fits)."""
    try:
        cuts = best(tables)
    except ValueError:
        return math.inf
    time = tables.time_table()
    edges = [0, *cuts, tables.units]
    return max(float(time[a, b]) for a, b in itertools.pairwise(edges))


def compare_policies(model: torch.nn.Module, example_inputs: Any, stages: int, **options: Any) -> dict[str, Any]:
    """The partition of every policy (None where a policy has no split for this model), traced once.

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8)) for _ in range(4)])
        >>> sorted(compare_policies(model, (torch.randn(2, 8),), 2))
        ['even-layers', 'fxforge', 'parameters']
    """
    options["microbatches"] = options.get("microbatches") or stages
    units = options.pop("units", None) or stage_units(model, example_inputs, microbatches=options["microbatches"],
                                                      machine=options.get("machine"),
                                                      costs=options.get("costs", "roofline"))
    found: dict[str, Any] = {}
    for policy in POLICIES:
        try:
            found[policy] = partition(model, example_inputs, stages, policy=policy, units=units, **options)
        except ValueError:
            if policy == "fxforge":
                raise
            found[policy] = None
    return found

