"""How long a pipeline step takes: the stages' forward and backward per microbatch played out in the order
a schedule runs them, each waiting for its inputs (the previous stage's forward, the next stage's
backward, plus the time to send them).

The orders are those of ``torch.distributed.pipelining``: ``GPipe`` runs every forward, then every
backward; ``1F1B`` runs ``k - 1 - s`` forwards on stage ``s`` to fill the pipe, then alternates one
forward and one backward, then drains the backwards. 1F1B holds fewer microbatches' activations; both
take the same time when the stages are balanced.

Example:
    >>> sim = simulate_pipeline([1.0, 1.0], [2.0, 2.0], microbatches=4, schedule="GPipe")
    >>> sim.makespan, round(sim.bubble, 3)            # 4 x 3 s of work per stage, 3 s idle each
    (15.0, 0.2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class SimulatedPipeline:
    """One step of a schedule, simulated.

    Attributes:
        schedule: ``"1F1B"`` or ``"GPipe"``.
        makespan: seconds from the first forward to the last backward.
        busy: per stage, seconds computing.
        samples: samples in the step (microbatches x microbatch size).
    """

    schedule: str
    makespan: float
    busy: tuple[float, ...]
    samples: int

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.samples / self.makespan if self.makespan > 0 else float("inf")

    @property
    def bubble(self) -> float:
        """The share of the stages' time spent idle."""
        stages = len(self.busy)
        return 1.0 - sum(self.busy) / (stages * self.makespan) if self.makespan > 0 else 0.0


def schedule_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The ``("F" | "B", microbatch)`` actions ``stage`` runs, in order.

    Example:
        >>> schedule_order("1F1B", 0, 2, 3)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    if schedule == "GPipe":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    if schedule != "1F1B":
        raise ValueError(f"unknown schedule {schedule!r}: 1F1B or GPipe")
    warmup = min(microbatches, stages - 1 - stage)
    order = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(microbatches - warmup, microbatches)]
    return order


def simulate_pipeline(forward: Sequence[float], backward: Sequence[float], *, microbatches: int,
                      schedule: str = "1F1B", send_forward: Sequence[float] | None = None,
                      send_backward: Sequence[float] | None = None, microbatch_size: int = 1) -> SimulatedPipeline:
    """Play one step out (module docstring).

    Args:
        forward, backward: per stage, seconds per microbatch.
        microbatches: microbatches in the step.
        schedule: ``"1F1B"`` or ``"GPipe"``.
        send_forward: per stage, seconds to send its activations on (the last stage's is unused).
        send_backward: per stage, seconds to send its input gradients back (the first stage's is unused).
        microbatch_size: samples per microbatch (for the throughput).
    """
    stages = len(forward)
    send_forward = list(send_forward or [0.0] * stages)
    send_backward = list(send_backward or [0.0] * stages)
    orders = [schedule_order(schedule, s, stages, microbatches) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    busy = [0.0] * stages
    cursor = [0] * stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            while cursor[s] < len(orders[s]):
                kind, i = orders[s][cursor[s]]
                if kind == "F":
                    deps = [] if s == 0 else [("F", s - 1, i, send_forward[s - 1])]
                else:
                    deps = [("F", s, i, 0.0)] + ([] if s == stages - 1 else [("B", s + 1, i, send_backward[s + 1])])
                if any((k, st, mb) not in done for k, st, mb, _ in deps):
                    break
                ready = max([free[s], *(done[(k, st, mb)] + delay for k, st, mb, delay in deps)])
                length = forward[s] if kind == "F" else backward[s]
                done[(kind, s, i)] = free[s] = ready + length
                busy[s] += length
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} schedule deadlocked in simulation")  # a bug, not an input error
    return SimulatedPipeline(schedule, max(free), tuple(busy), microbatches * microbatch_size)
