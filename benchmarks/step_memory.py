"""Peak memory of one training step on CPU, measured the same way whatever runs the step.

A step (forward, loss, backward, optimizer step) runs under ``torch.profiler`` with ``profile_memory=True``:
PyTorch's CPU allocator reports every allocation and free to the profiler, whoever asks for the memory:
ATen ops, a kernel's scratch buffers, the buffers the code Inductor generates allocates itself
(``empty_strided_cpu``, outside the dispatcher, where fxforge's dispatch-mode ``StorageTracker`` does not
look). Summed in time order, the records give the bytes held at every moment above the level at the
step's start; the peak is the largest (:func:`benchmarks.memory.peak_from_records` does the sum).

The records are fxforge's :class:`~fxforge.runtime.allocator.AllocatorRecords` (the reader
``TrainingMemory.measure()`` and ``target="inductor"``'s check of its plan use), given the parameters: it
tells their gradients from activations from the allocation of each gradient's storage on. One more mark
goes into the timeline: the backward has returned (:func:`mark`, called by the step): the activation peak is
taken over the forward and the backward only, the optimizer step's temporaries are not activations.

So ``activation_peak_bytes`` = max over forward and backward of (held above the start - parameter gradients
allocated so far): the most bytes alive at once beyond weights, buffers, optimizer state, inputs and parameter
gradients, the definition fxforge's checkpointing budget uses.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    >>> x = torch.randn(64, 256)
    >>> def step():
    ...     model(x).sum().backward()
    ...     mark("backward")
    ...     for p in model.parameters():
    ...         p.grad = None
    >>> m = step_peak(step, model.parameters())
    >>> m.gradient_bytes, m.end_bytes
    (264196, 0)
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterable
from typing import Any

import torch

from benchmarks.memory import peak_from_records
from fxforge.runtime.allocator import AllocatorRecords


@dataclasses.dataclass(frozen=True)
class StepPeak:
    """What one measured step held, in bytes above the level at its start.

    Attributes:
        peak_bytes: the most bytes held at once during the whole step.
        activation_peak_bytes: the most held at once during the forward and backward (up to the
            ``"backward"`` mark, or the whole step without it), less the parameter gradients allocated by then.
        gradient_bytes: the parameter gradients the step accumulated (first accumulation per parameter).
        allocated_bytes, allocations: the sum and count of the step's allocations.
        end_bytes: held at the end above the start (0 in a steady state where the step drops its gradients).

    Example:
        >>> StepPeak(3 * 2**20, 2**20, 0, 0, 0, 0).peak_mib
        3.0
    """

    peak_bytes: int
    activation_peak_bytes: int
    gradient_bytes: int
    allocated_bytes: int
    allocations: int
    end_bytes: int

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20


def mark(name: str) -> None:
    """A point of the step the measurement can find in the profiler's timeline (``"backward"``: the
    backward has returned). Costs nothing outside :func:`step_peak`.

    Example:
        >>> mark("backward")
    """
    AllocatorRecords.mark(name)


def step_peak(step: Callable[[], Any], params: Iterable[torch.Tensor]) -> StepPeak:
    """Run ``step()`` once under the profiler and return its :class:`StepPeak`.

    ``step`` should drop what it creates (loss, outputs, gradients with ``zero_grad(set_to_none=True)``) and
    call :func:`mark` ``("backward")`` once its backward has returned. Run it after a warm-up step (the
    optimizer's state, compiled code), apart from timed steps: recording every allocation slows it down.
    The cyclic garbage collector is paused during the step (garbage from before would be freed inside it).

    Args:
        step: one training step.
        params: the parameters whose gradients the step accumulates (their marks tell gradients from
            activations).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(1024))
        >>> m = step_peak(lambda: (w * 2).sum().backward(), [w])
        >>> m.gradient_bytes, m.end_bytes           # the gradient (4 KiB) is still alive at the end
        (4096, 4096)
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with AllocatorRecords(gradients_of=params) as records:
            step()
    finally:
        if enabled:
            gc.enable()
    peak, allocated, count = peak_from_records([(a.time_ns, a.nbytes) for a in records.allocations])
    until = "backward" if "backward" in records.marks else None
    return StepPeak(peak, records.activation_peak_bytes(until), records.gradient_bytes(), allocated, count,
                    records.held_bytes())


def tracker_peak(step: Callable[[], Any]) -> int:
    """The step's peak above its start by fxforge's dispatch-mode tracker (:class:`StorageTracker`): every
    storage an ATen op returns, freed when its finalizer runs. The cross-check of :func:`step_peak` on code
    that goes through the dispatcher (eager); it does not see kernels' scratch nor Inductor's buffers.

    Example:
        >>> tracker_peak(lambda: torch.ones(1024) * 2)
        8192
    """
    from fxforge.runtime.memory import StorageTracker

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with StorageTracker() as tracker:
            step()
    finally:
        if enabled:
            gc.enable()
    return tracker.peak
