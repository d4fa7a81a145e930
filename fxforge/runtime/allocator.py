"""The CPU allocator's own records of a block of code: every allocation and free, through ``torch.profiler``.

With ``profile_memory=True`` PyTorch's CPU allocator reports each allocation and free to the profiler, whoever
asks for the memory: an ATen op's result, the copy a kernel makes of an operand it cannot read in place
(a matrix product of a sum's gradient copies it), the buffers compiled code allocates outside the dispatcher.
A dispatch mode (:class:`fxforge.runtime.memory.StorageTracker`) sees only the storages ATen ops return, so
these records are the CPU's counterpart of the CUDA caching allocator's statistics.

:class:`AllocatorRecords` records a block; :meth:`AllocatorRecords.mark` drops named points into the same
timeline (``record_function`` events on the profiler's clock); after the block, :meth:`AllocatorRecords.phases`
gives the peak and the bytes held at each point, above the level at the block's start.

Given parameters (``gradients_of=``), the records also tell their gradients from activations: the first
accumulation of each parameter's gradient leaves a mark carrying the gradient's address, which finds the
allocation of its storage; from that allocation on its bytes are a gradient. A compiled backward (Inductor,
any AOTAutograd graph) computes every gradient inside one graph and hands them all to autograd when it
returns, so a gradient counted from its accumulation would be an activation until the backward's end.
:meth:`AllocatorRecords.activation_peak_bytes` is the most held at once less the gradients allocated by then:
the activation peak a checkpointing budget bounds.

Example:
    >>> with AllocatorRecords() as records:
    ...     a = torch.ones(1024)          # 4 KiB
    ...     b = a.add(a)                  # 4 KiB more (a Python number would add a scalar tensor)
    ...     records.mark("made")
    ...     del a, b
    >>> records.phases(["made"])["made"]
    Phase(peak_bytes=8192, held_bytes=8192)
    >>> records.held_bytes()              # both freed by the end
    0
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

MARK = "fxforge::allocator::"
GRADIENT_MARK = "fxforge::allocator-gradient::"


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One record of the CPU allocator: ``nbytes`` > 0 allocates at ``address``, < 0 frees it."""

    time_ns: int
    nbytes: int
    address: int


@dataclasses.dataclass(frozen=True)
class Phase:
    """Between the previous mark (or the start) and a mark: the most bytes held at once, and the bytes held
    at the mark, both above the level at the start of the records."""

    peak_bytes: int
    held_bytes: int


def walk(events: Iterable[Any]) -> Iterable[Any]:
    """Every event of the profiler's event tree, parents before their children.

    Example:
        >>> list(walk([]))
        []
    """
    for event in events:
        yield event
        yield from walk(event.children)


def event_tree(prof: Any) -> list[Any]:
    """The roots of a finished ``torch.profiler.profile``'s event tree (one clear error if it recorded none).

    Example:
        >>> from torch.profiler import ProfilerActivity, profile
        >>> with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ...     _ = torch.ones(8)
        >>> len(event_tree(prof)) > 0
        True
    """
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        raise RuntimeError("torch.profiler recorded no events: cannot read the CPU allocator's records")
    return results.experimental_event_tree()


def cpu_allocations(events: Iterable[Any]) -> list[Allocation]:
    """The CPU allocator's records among profiler events (:func:`walk` them first), in time order.

    Example:
        >>> cpu_allocations([])
        []
    """
    from torch._C._profiler import _EventType

    found = [Allocation(e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr) for e in events
             if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"]
    return sorted(found, key=lambda a: a.time_ns)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null within it: the profiler's C++ side prints a line to stderr when a session
    starts and stops (``USDT: ... profiler_start``), whatever its log level, which a command's user should not
    see. Only the start and the stop run inside it, never the user's code."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no file descriptor 2 to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class AllocatorRecords:
    """A context manager that records the CPU allocator's allocations and frees inside it (see the module).

    The cyclic garbage collector keeps running; call ``gc.collect()`` before the block if garbage from
    before it could be freed inside it. Recording every allocation slows the block down: measure apart from
    timed runs.

    Attributes (read after the block):
        allocations: the records, in time order.
        marks: the time of each :meth:`mark`, by name.
        gradients: ``(time ns, bytes)`` per parameter of ``gradients_of`` whose gradient the block accumulated:
            the time of its storage's allocation (of its first accumulation where no allocation in the block
            holds its address: it was allocated before).

    Example:
        >>> with AllocatorRecords() as records:
        ...     _ = torch.ones(256).mul(torch.ones(256))
        >>> records.peak_bytes()          # two vectors of ones and their product at once
        3072
    """

    def __init__(self, gradients_of: Iterable[torch.Tensor] = ()) -> None:
        self.allocations: list[Allocation] = []
        self.marks: dict[str, int] = {}
        self.gradients: list[tuple[int, int]] = []
        self._params = [p for p in {id(p): p for p in gradients_of}.values() if p.requires_grad]
        self._hooks: list[Any] = []
        self._prof: Any = None

    def __enter__(self) -> AllocatorRecords:  # noqa: PYI034 - returns itself, as a context manager does
        from torch.profiler import ProfilerActivity, profile

        if not self.available():
            # A second session would end the first one when it exits.
            raise RuntimeError("torch.profiler is already recording: the CPU allocator's records need a profiler "
                               "session of their own; measure outside the other one")
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._prof.__enter__()
        seen: set[int] = set()

        def accumulated(p: torch.Tensor) -> None:
            if id(p) not in seen:
                seen.add(id(p))
                with torch.profiler.record_function(f"{GRADIENT_MARK}{p.numel() * p.element_size()}"
                                                    f"@{p.grad.data_ptr()}"):
                    pass

        self._hooks = [p.register_post_accumulate_grad_hook(accumulated) for p in self._params]
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        events = list(walk(event_tree(self._prof)))
        self.allocations = cpu_allocations(events)
        gradients = []
        for event in events:
            if event.name.startswith(MARK):
                self.marks.setdefault(event.name[len(MARK):], event.start_time_ns)
            elif event.name.startswith(GRADIENT_MARK):
                nbytes, _, address = event.name[len(GRADIENT_MARK):].partition("@")
                gradients.append((event.start_time_ns, int(nbytes), int(address)))
        self.gradients = _gradient_allocations(self.allocations, gradients)

    @staticmethod
    def available() -> bool:
        """Whether records can start here: not inside another ``torch.profiler`` session.

        Example:
            >>> AllocatorRecords.available()
            True
        """
        return not torch.autograd.profiler._is_profiler_enabled

    @staticmethod
    def mark(name: str) -> None:
        """A named point of the recorded block (the first one of each name counts)."""
        with torch.profiler.record_function(MARK + name):
            pass

    def phases(self, names: Sequence[str]) -> dict[str, Phase]:
        """Per mark, in the order given (which must be the marks' order in time): the peak since the previous
        mark and the bytes held at it."""
        result: dict[str, Phase] = {}
        held = peak = i = 0
        for name in names:
            until = self.marks[name]
            while i < len(self.allocations) and self.allocations[i].time_ns <= until:
                held += self.allocations[i].nbytes
                peak = max(peak, held)
                i += 1
            result[name] = Phase(peak, held)
            peak = held
        return result

    def peak_bytes(self) -> int:
        """The most bytes held at once during the block, above its start."""
        held = peak = 0
        for record in self.allocations:
            held += record.nbytes
            peak = max(peak, held)
        return peak

    def held_bytes(self) -> int:
        """Bytes allocated in the block and not freed by its end."""
        return sum(record.nbytes for record in self.allocations)

    def gradient_bytes(self) -> int:
        """Bytes of the gradients the block accumulated (first accumulation per parameter of ``gradients_of``)."""
        return sum(nbytes for _, nbytes in self.gradients)

    def activation_peak_bytes(self, until: str | None = None) -> int:
        """The most bytes held at once above the start, up to the mark ``until`` (None: the whole block), less
        the gradients of ``gradients_of`` allocated by then.

        Example:
            >>> w = torch.nn.Parameter(torch.ones(1024))
            >>> with AllocatorRecords(gradients_of=[w]) as records:
            ...     y = w.tanh()                    # 4 KiB, saved for the backward
            ...     y.sum().backward()              # w's gradient (4 KiB) computed while y is alive
            ...     del y
            >>> [n // 1024 for n in (records.peak_bytes(), records.activation_peak_bytes(), records.gradient_bytes())]
            [8, 4, 4]
        """
        return activation_peak([(a.time_ns, a.nbytes) for a in self.allocations], self.gradients,
                               self.marks[until] if until is not None else None)


def _gradient_allocations(allocations: list[Allocation], marks: list[tuple[int, int, int]]
                          ) -> list[tuple[int, int]]:
    """``(time, bytes)`` per gradient mark ``(time, bytes, address)``: the time of the allocation of the block
    holding its address, alive at the mark (the mark's own time where none is: allocated before the records)."""
    found, live, i = [], {}, 0
    for t_mark, nbytes, address in sorted(marks):
        while i < len(allocations) and allocations[i].time_ns <= t_mark:
            record = allocations[i]
            if record.nbytes > 0:
                live[record.address] = (record.time_ns, record.nbytes)
            else:
                live.pop(record.address, None)
            i += 1
        block = live.get(address) or next((v for a, v in live.items() if a <= address < a + v[1]), None)
        found.append((block[0] if block else t_mark, nbytes))
    return found


def activation_peak(memory: Iterable[tuple[int, int]], gradients: Iterable[tuple[int, int]],
                    until: int | None = None) -> int:
    """The most bytes held at once before ``until`` (ns; None: all), the gradients allocated by then left out:
    ``memory`` is ``(time, bytes)`` records (< 0 a free), ``gradients`` ``(time of allocation, bytes)``.

    A gradient found at its storage's allocation is never an activation, not even at that instant: at equal
    times it is taken out before the allocation is counted (after it, a gradient a compiled backward allocates
    while a large temporary is alive would count for a moment: 7.8 MiB on LLaMA's LM head).

    Example:
        >>> activation_peak([(0, 100), (1, 40), (3, -100), (5, 60)], [(2, 40)])   # 40 B become a gradient
        140
        >>> activation_peak([(0, 100), (1, 40), (2, -100)], [(1, 40)])          # a gradient from the start
        100
    """
    merged = sorted([(t, 1, n) for t, n in memory] + [(t, 0, -n) for t, n in gradients])
    held = peak = 0
    for t, _, delta in merged:
        if until is not None and t > until:
            break
        held += delta
        peak = max(peak, held)
    return peak
