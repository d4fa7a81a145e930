"""Choosing where the stages begin: the split that minimises the slowest stage, exactly, by dynamic
programming over the units; and the two splits users would otherwise take (even by layer, even by
parameter size).

A stage is a run of consecutive units ``[a, b)``. Its time per microbatch is its forward + backward
compute plus the bytes it sends (activations to later stages, gradients back to earlier ones) at the
link's bandwidth; its memory is the weights it holds (a parameter several stages use is replicated to
each, as ``torch.distributed.pipelining`` does), their gradients, and per microbatch in flight its saved
activations and the inputs it received. Every one of these is a table over ``(a, b)``
(:class:`StageTables`); the dynamic program then finds the cut points that minimise the largest stage
time with every stage inside the memory cap, in ``O(k U^2)``: exact for the chain of units.

Example:
    >>> tables = StageTables.of_costs([2.0, 1.0, 1.0, 1.0, 1.0])
    >>> best_split(tables, 2)                       # 2 + 1 | 1 + 1 + 1
    [2]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from fxforge.parallel.units import Item, StageUnits

SCHEDULES = ("1F1B", "GPipe")
"""Schedules the simulator and the memory model know."""


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Microbatches whose activations ``stage`` holds at once: all of them in GPipe, at most the stages
    from it to the last in 1F1B.

    Example:
        >>> [in_flight("1F1B", s, 4, 8) for s in range(4)], in_flight("GPipe", 0, 4, 8)
        ([4, 3, 2, 1], 8)
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    return microbatches if schedule == "GPipe" else min(microbatches, stages - stage)


def _any_use(items: Sequence[Item], units: int, *, made_before: bool = False) -> np.ndarray:
    """``T[a, b]``: the bytes of the items used by some unit in ``[a, b)`` (with ``made_before``, only items
    made before ``a``)."""
    table = np.zeros((units + 1, units + 2))
    for item in items:
        uses = np.asarray(item.uses, dtype=np.int64)
        if not len(uses):
            continue
        starts = np.arange(0, uses[-1] + 1)
        if made_before:
            starts = starts[starts > item.unit]
        next_use = uses[np.searchsorted(uses, starts)]
        np.add.at(table, (starts, next_use + 1), item.nbytes)
    return np.cumsum(table, axis=1)[:, :units + 1]


def _sent_on(values: Sequence[Item], units: int) -> np.ndarray:
    """``T[a, b]``: the bytes of the values made in ``[a, b)`` and used at ``b`` or after."""
    table = np.zeros((units + 2, units + 2))
    for v in values:
        made, last = v.unit, v.uses[-1]
        if last <= made:
            continue
        table[0, made + 1] += v.nbytes
        table[0, last + 1] -= v.nbytes
        table[made + 1, made + 1] -= v.nbytes
        table[made + 1, last + 1] += v.nbytes
    return np.cumsum(np.cumsum(table, axis=0), axis=1)[:units + 1, :units + 1]


def _span(per_unit: Sequence[float]) -> np.ndarray:
    """``T[a, b]``: the sum of ``per_unit`` over the units ``[a, b)``."""
    prefix = np.concatenate([[0.0], np.cumsum(per_unit)])
    return prefix[None, :] - prefix[:, None]


@dataclasses.dataclass
class StageTables:
    """Per candidate stage ``[a, b)`` of units (``0 <= a < b <= U``): what it costs and holds.

    Attributes:
        forward, backward: compute seconds per microbatch.
        sent: activation bytes it sends on per microbatch; grads_sent: gradient bytes it sends back.
        received: bytes of earlier values it receives (and keeps for its backward) per microbatch.
        saved: bytes its own forward saves for its backward per microbatch.
        weights: bytes of the parameters and buffers it uses; weight_grads: of its trainable parameters.
        link_gbs: the link's bandwidth, GB/s, that turns bytes sent into seconds.
    """

    forward: np.ndarray
    backward: np.ndarray
    sent: np.ndarray
    grads_sent: np.ndarray
    received: np.ndarray
    saved: np.ndarray
    weights: np.ndarray
    weight_grads: np.ndarray
    link_gbs: float = 12.5

    @property
    def units(self) -> int:
        return self.forward.shape[0] - 1

    @classmethod
    def of_units(cls, units: StageUnits, link_gbs: float = 12.5) -> StageTables:
        """The tables of a traced model (:func:`fxforge.parallel.units.stage_units`)."""
        count = len(units)
        state = [*units.parameters, *units.buffers]
        return cls(_span(units.forward_seconds), _span(units.backward_seconds), _sent_on(units.values, count),
                   _any_use([v for v in units.values if v.grad], count, made_before=True),
                   _any_use(units.values, count, made_before=True), _span(units.saved_bytes),
                   _any_use(state, count), _any_use([p for p in units.parameters if p.grad], count), link_gbs)

    @classmethod
    def of_costs(cls, seconds: Sequence[float], memory: Sequence[float] | None = None,
                 sent: Sequence[float] | None = None, link_gbs: float = 1.0) -> StageTables:
        """Tables of a plain chain: per unit compute ``seconds``, ``memory`` (bytes held, as weights), and
        the bytes ``sent[i]`` crossing from unit ``i`` to ``i + 1`` (tests and worked examples).

        Example:
            >>> StageTables.of_costs([1.0, 2.0]).seconds(0, 2)
            3.0
        """
        count = len(seconds)
        zero = np.zeros((count + 1, count + 1))
        crossing = np.zeros((count + 1, count + 1))
        for b in range(1, count):
            crossing[:b, b] = (sent or [0.0] * count)[b - 1]
        return cls(_span(seconds), zero.copy(), crossing, zero.copy(), zero.copy(), zero.copy(),
                   _span(memory or [0.0] * count), zero.copy(), link_gbs)

    def seconds(self, a: int, b: int) -> float:
        """Stage ``[a, b)``'s time per microbatch: compute plus what it sends at the link's bandwidth."""
        return float(self.time_table()[a, b])

    def time_table(self) -> np.ndarray:
        """:meth:`seconds` for every ``(a, b)`` at once."""
        return self.forward + self.backward + (self.sent + self.grads_sent) / (self.link_gbs * 1e9)

    def memory_table(self, in_flight_microbatches: int) -> np.ndarray:
        """Bytes stage ``[a, b)`` holds at its peak with that many microbatches' activations alive."""
        return self.weights + self.weight_grads + in_flight_microbatches * (self.saved + self.received)


def best_split(tables: StageTables, stages: int, *, memory_per_stage: float | None = None,
               microbatches: int = 1, schedule: str = "1F1B", forbidden: frozenset[int] = frozenset()) -> list[int]:
    """The units where stages 1..k-1 begin, minimising the slowest stage's time with every stage's memory
    within ``memory_per_stage`` (exact over the chain of units; ties go to the least total time). No stage
    begins at a unit in ``forbidden``.

    Raises:
        ValueError: fewer units than stages, or no split fits the memory cap (the message gives the
            least cap that would).

    Example:
        >>> best_split(StageTables.of_costs([4.0, 1.0, 1.0, 1.0, 1.0]), 2)     # 4 | 1+1+1+1
        [1]
    """
    count = tables.units
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if count < stages:
        raise ValueError(f"the model has {count} places to split ({count} units) but {stages} stages were asked for")
    time = tables.time_table()
    inf = math.inf
    upper = np.triu(np.ones((count + 1, count + 1), dtype=bool), 1)
    fits = [upper.copy() for _ in range(stages)]
    if memory_per_stage is not None:
        for s in range(stages):
            fits[s] &= tables.memory_table(in_flight(schedule, s, stages, microbatches)) <= memory_per_stage
    # best[s][b]: the least slowest-stage time of stages 0..s covering units [0, b); total breaks ties.
    best = np.full((stages, count + 1), inf)
    total = np.full((stages, count + 1), inf)
    choice = np.zeros((stages, count + 1), dtype=np.int64)
    best[0] = np.where(fits[0][0], time[0], inf)
    total[0] = best[0]
    for s in range(1, stages):
        for b in range(s + 1, count + 1):
            a = np.array([u for u in range(s, b) if u not in forbidden], dtype=np.int64)
            if not len(a):
                continue
            worst = np.maximum(best[s - 1][a], np.where(fits[s][a, b], time[a, b], inf))
            summed = total[s - 1][a] + time[a, b]
            order = np.lexsort((summed, worst))
            best[s][b], total[s][b], choice[s][b] = worst[order[0]], summed[order[0]], a[order[0]]
    if not math.isfinite(best[stages - 1][count]):
        raise ValueError(_memory_refusal(tables, stages, memory_per_stage, microbatches, schedule))
    cuts, b = [], count
    for s in range(stages - 1, 0, -1):
        b = int(choice[s][b])
        cuts.append(b)
    return cuts[::-1]


def _memory_refusal(tables: StageTables, stages: int, cap: float | None, microbatches: int, schedule: str) -> str:
    least = math.inf
    for cuts in _some_splits(tables.units, stages):
        edges = [0, *cuts, tables.units]
        need = max(tables.memory_table(in_flight(schedule, s, stages, microbatches))[edges[s], edges[s + 1]]
                   for s in range(stages))
        least = min(least, need)
    cap_text = f"{cap / 2**20:.1f} MiB" if cap is not None else "none"
    return (f"no split into {stages} stages fits {cap_text} per stage with {microbatches} microbatches "
            f"({schedule}); the least any split needs is about {least / 2**20:.1f} MiB")


def _some_splits(units: int, stages: int, limit: int = 20000):
    """All splits when there are few, else the even ones and a sample (for the refusal's figure)."""
    if math.comb(units - 1, stages - 1) <= limit:
        yield from (list(c) for c in itertools.combinations(range(1, units), stages - 1))
        return
    rng = np.random.default_rng(0)
    yield [round(s * units / stages) for s in range(1, stages)]
    for _ in range(limit):
        yield sorted(rng.choice(np.arange(1, units), stages - 1, replace=False).tolist())


def brute_force_split(tables: StageTables, stages: int, *, memory_per_stage: float | None = None,
                      microbatches: int = 1, schedule: str = "1F1B") -> tuple[float, list[int]] | None:
    """The least slowest-stage time over every split, and one split reaching it (None if none fits):
    what :func:`best_split` must equal, for tests on small chains.

    Example:
        >>> brute_force_split(StageTables.of_costs([4.0, 1.0, 1.0, 1.0, 1.0]), 2)
        (4.0, [1])
    """
    time = tables.time_table()
    memory = [tables.memory_table(in_flight(schedule, s, stages, microbatches)) for s in range(stages)]
    best = None
    for cuts in itertools.combinations(range(1, tables.units), stages - 1):
        edges = [0, *cuts, tables.units]
        if memory_per_stage is not None and any(memory[s][edges[s], edges[s + 1]] > memory_per_stage
                                                for s in range(stages)):
            continue
        worst = max(time[edges[s], edges[s + 1]] for s in range(stages))
        if best is None or worst < best[0]:
            best = (float(worst), list(cuts))
    return best


def block_names(names: Sequence[str], model: torch.nn.Module) -> list[str]:
    """The model's repeated blocks among the split candidates: the outermost submodules that are items of
    a ``ModuleList``/``Sequential`` (named by their index) and have submodules of their own (transformer
    layers, ResNet bottlenecks), in order.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.ReLU())
        >>> block_names(["", "0", "0.0", "1"], m)
        ['0']
    """
    blocks: list[str] = []
    for name in names:
        if not name or not name.rsplit(".", 1)[-1].isdigit():
            continue
        if not any(True for _ in model.get_submodule(name).children()):
            continue
        if any(name.startswith(b + ".") for b in blocks):
            continue
        blocks.append(name)
    return blocks


def even_layer_split(names: Sequence[str], model: torch.nn.Module, stages: int) -> list[int] | None:
    """torchtitan's split: the blocks divided evenly by count (what comes before the first block goes with
    the first stage, what follows the last with the last). None when there are fewer blocks than stages.

    Example:
        >>> m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2, 2)) for _ in range(4)])
        >>> even_layer_split(["", "0", "1", "2", "3"], m, 2)
        [3]
    """
    blocks = block_names(names, model)
    if len(blocks) < stages:
        return None
    index = {name: i for i, name in enumerate(names)}
    return [index[blocks[round(s * len(blocks) / stages)]] for s in range(1, stages)]


def parameter_split(units: StageUnits, stages: int) -> list[int] | None:
    """PiPPy's old policy (``split_into_equal_size``): walk the units in order and begin a new stage once
    the parameters seen reach the next ``1/k`` of the total (each parameter counted where first used).
    None when the parameters cannot fill ``k`` non-empty stages.

    Example:
        >>> units = StageUnits(["", "a", "b", "c"], *[np.zeros(4)] * 4,
        ...                    [Item(n, 4, -1, (i,), True) for i, n in enumerate("wxyz")], [], [], ((), {}), None)
        >>> parameter_split(units, 2)
        [2]
    """
    per_unit = np.zeros(len(units))
    for p in units.parameters:
        if p.uses:
            per_unit[p.uses[0]] += p.nbytes
    total = per_unit.sum()
    if total <= 0:
        return None
    seen = np.cumsum(per_unit)
    cuts: list[int] = []
    for s in range(1, stages):
        after = int(np.searchsorted(seen, s * total / stages - 1e-9)) + 1  # first unit past the threshold
        after = max(after, (cuts[-1] + 1) if cuts else 1)
        if after >= len(units):
            return None
        cuts.append(after)
    return cuts
