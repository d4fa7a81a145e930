"""Peak memory of one training step on CPU, measured the same way whatever runs the step.

A step (forward, loss, backward, optimizer step) runs under ``torch.profiler`` with ``profile_memory=True``:
PyTorch's CPU allocator reports every allocation and free to the profiler, whoever asks for the memory:
ATen ops, a kernel's scratch buffers, the buffers the code Inductor generates allocates itself
(``empty_strided_cpu``, outside the dispatcher, where fxforge's dispatch-mode ``StorageTracker`` does not
look). Summed in time order, the records give the bytes held at every moment above the level at the
step's start; the peak is the largest (:func:`benchmarks.memory.peak_from_records` does the sum).

The records are read from the profiler's event tree, where each allocation carries its address. Two
markers go into the same timeline, as ``record_function`` events on the profiler's clock:

- a parameter's gradient is accumulated (a post-accumulate-grad hook, the first time per parameter); the
  mark carries the gradient's address, which finds the allocation of its storage: from that allocation on,
  its bytes count as a gradient, not an activation. This matters for compiled backwards (Inductor,
  fxforge, any AOTAutograd graph), which compute every parameter gradient inside one graph and hand them all
  to autograd when the graph returns: counted from the accumulation, a gradient computed early would count as
  an activation until the end of the backward;
- the backward has returned (:func:`mark`, called by the step): the activation peak is taken over the
  forward and the backward only, the optimizer step's temporaries are not activations.

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

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterable
from typing import Any

import torch

from benchmarks.memory import peak_from_records
from fxforge.runtime.allocator import cpu_allocations, event_tree, walk

GRAD_MARK = "step_memory::grad:"
PHASE_MARK = "step_memory::phase:"


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
    with torch.profiler.record_function(PHASE_MARK + name):
        pass


@contextlib.contextmanager
def _gradient_marks(params: Iterable[torch.Tensor]):
    """Within it, the first accumulation of each parameter's gradient leaves a mark with its bytes."""
    seen: set[int] = set()

    def hook(p: torch.Tensor) -> None:
        if id(p) in seen:
            return
        seen.add(id(p))
        with torch.profiler.record_function(f"{GRAD_MARK}{p.numel() * p.element_size()}@{p.grad.data_ptr()}"):
            pass

    handles = [p.register_post_accumulate_grad_hook(hook)
               for p in dict.fromkeys(params) if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def timeline(roots: Iterable[Any]) -> tuple[list[tuple[int, int]], list[tuple[int, int]], dict[str, int]]:
    """``(memory, gradients, phases)`` from the profiler's event tree: ``(time ns, bytes)`` CPU allocator records
    (bytes < 0: a free), ``(time ns, bytes)`` per gradient at the allocation of its storage (at its mark where
    no allocation holds its address: it was allocated before the step), and the time of each phase mark."""
    events = list(walk(roots))
    allocations = [(a.time_ns, a.nbytes, a.address) for a in cpu_allocations(events)]
    marks, phases = [], {}
    for event in events:
        if event.name.startswith(GRAD_MARK):
            nbytes, _, ptr = event.name[len(GRAD_MARK):].partition("@")
            marks.append((event.start_time_ns, int(nbytes), int(ptr)))
        elif event.name.startswith(PHASE_MARK):
            phases.setdefault(event.name[len(PHASE_MARK):], event.start_time_ns)
    grads, live, i = [], {}, 0
    for t_mark, nbytes, ptr in sorted(marks):
        while i < len(allocations) and allocations[i][0] <= t_mark:
            t, size, address = allocations[i]
            if size > 0:
                live[address] = (t, size)
            else:
                live.pop(address, None)
            i += 1
        block = live.get(ptr) or next((v for a, v in live.items() if a <= ptr < a + v[1]), None)
        grads.append((block[0] if block else t_mark, nbytes))
    return [(t, size) for t, size, _ in allocations], grads, phases


def activation_peak(memory: list[tuple[int, int]], grads: list[tuple[int, int]], until: int | None = None) -> int:
    """The most bytes held at once before ``until`` (ns; None: all), the gradients allocated by then left out.

    A gradient found at its storage's allocation is never an activation, not even at that instant: at equal
    times it is taken out before the allocation is counted (after it, a gradient a compiled backward allocates
    while a large temporary is alive would count for a moment: 7.8 MiB on LLaMA's LM head, all of the gap
    between the plans' predicted activation peaks and these measured ones before 2026-11-25).

    Example:
        >>> activation_peak([(0, 100), (1, 40), (3, -100), (5, 60)], [(2, 40)])   # 40 B become a gradient
        140
        >>> activation_peak([(0, 100), (1, 40), (2, -100)], [(1, 40)])          # a gradient from the start
        100
    """
    merged = sorted([(t, 1, n) for t, n in memory] + [(t, 0, -n) for t, n in grads])
    held = peak = 0
    for t, _, delta in merged:
        if until is not None and t > until:
            break
        held += delta
        peak = max(peak, held)
    return peak


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
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with _gradient_marks(params), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        if enabled:
            gc.enable()
    memory, grads, phases = timeline(event_tree(prof))
    peak, allocated, count = peak_from_records(memory)
    return StepPeak(peak, activation_peak(memory, grads, phases.get("backward")), sum(n for _, n in grads),
                    allocated, count, sum(n for _, n in memory))


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
