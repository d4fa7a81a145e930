"""Peak activation memory of a graph, measured while it runs.

:func:`measure_peak` runs the graph and measures what :func:`fxforge.core.memory.simulate_peak` simulates:
on CPU with a ``TorchDispatchMode`` that sees every ATen op's inputs and outputs, counts each storage
created during the run at its size, and uncounts it when a weakref finalizer says the storage was freed,
sampling the live total after each op. On CUDA it also reads the caching allocator's peak (which includes
kernel workspaces and the 512-byte rounding of blocks, so it is the one of the two that can exceed the
simulation).

Where the simulation and the dispatch-mode measurement can differ: a call that runs several ATen ops
holds intermediate tensors the graph does not show (an opaque module's internals, attention's math path)
unless :func:`~fxforge.core.memory.scratch_bytes` knows them; some composite ops take another path while
any dispatch mode is active (``max_pool1d`` computes indices then, which it does not on CPU without grad),
which the measurement sees and the simulation rightly does not; an opaque module that returns its own
buffer is counted as an allocation by the simulation and not by the measurement.

Example:
    >>> from fxforge.core.memory import simulate_peak
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         a = x * 2
    ...         return a.view(-1) * torch.relu(a).view(-1)
    >>> gm = fxforge.capture(Net(), (torch.ones(32, 32),)).graph_module
    >>> measure_peak(gm, torch.ones(32, 32)).peak_bytes == simulate_peak(gm).peak_bytes == 12288
    True
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxforge.core.memory import tensor_leaves


@dataclasses.dataclass(frozen=True)
class PeakMeasurement:
    """The measured peak of one run of a graph.

    Attributes:
        peak_bytes: the device's figure: ``allocator_peak_bytes`` on CUDA, ``tracked_peak_bytes`` on CPU.
        tracked_peak_bytes: the most bytes alive at once in storages created during the run, sampled
            after each ATen op by a dispatch mode (the simulation's accounting).
        allocator_peak_bytes: CUDA only: the caching allocator's peak above its level at the start
            (includes kernel workspaces and block rounding); None on CPU.
        allocations: storages created during the run.
        device: ``"cpu"`` or ``"cuda"``.

    Example:
        >>> PeakMeasurement(2**20, 2**20, None, 3, "cpu").peak_mib
        1.0
    """

    peak_bytes: int
    tracked_peak_bytes: int
    allocator_peak_bytes: int | None
    allocations: int
    device: str = "cpu"

    @property
    def peak_mib(self) -> float:
        """The peak in MiB."""
        return self.peak_bytes / 2**20


class StorageTracker(TorchDispatchMode):
    """A dispatch mode that follows the storages created while it is active.

    Each ATen op's input storages that it has not seen are noted as existing before (never counted);
    each output storage it has not seen is new: its bytes are added to ``live`` and a weakref finalizer
    on the storage takes them off again when it is freed. ``peak`` is the largest ``live`` after an op.

    Example:
        >>> x = torch.ones(256)
        >>> with StorageTracker() as tracker:
        ...     y = (x + 1) * 2     # x + 1 is freed once the product exists
        >>> tracker.peak, tracker.live, tracker.allocations
        (2048, 1024, 2)
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.allocations = 0
        self._seen: dict[int, weakref.finalize] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in tensor_leaves((args, kwargs)):
            self._note(leaf, new=False)
        out = func(*args, **kwargs)
        for leaf in tensor_leaves(out):
            self._note(leaf, new=True)
        self.peak = max(self.peak, self.live)
        return out

    def _note(self, tensor: torch.Tensor, new: bool) -> None:
        try:
            storage = tensor.untyped_storage()
        except Exception:  # noqa: BLE001 - no storage (sparse, nested): nothing to follow
            return
        key = storage._cdata
        if key in self._seen:
            return
        nbytes = int(storage.nbytes()) if new else 0
        finalizer = weakref.finalize(storage, self._freed, key, nbytes)
        finalizer.atexit = False
        self._seen[key] = finalizer
        if nbytes:
            self.live += nbytes
            self.allocations += 1

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.pop(key, None)
        self.live -= nbytes

    def __exit__(self, *exc: object) -> Any:
        result = super().__exit__(*exc)
        for finalizer in list(self._seen.values()):
            finalizer.detach()  # storages still alive (outputs, parameters) stop being followed
        self._seen.clear()
        return result


def device_of(graph_module: torch.nn.Module, values: Iterable[Any]) -> torch.device:
    """The device a graph runs on: the first input, parameter or buffer off the CPU (meta tensors aside).

    Example:
        >>> device_of(torch.nn.Linear(2, 2), [torch.ones(2)])
        device(type='cpu')
    """
    for leaf in tensor_leaves(list(values)):
        if leaf.device.type not in ("cpu", "meta"):
            return leaf.device
    for tensor in [*graph_module.parameters(), *graph_module.buffers()]:
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device
    return torch.device("cpu")


def measure_peak(graph_module: torch.nn.Module, *args: Any, **kwargs: Any) -> PeakMeasurement:
    """Run ``graph_module(*args, **kwargs)`` once under ``torch.no_grad()`` and measure its peak.

    Counts only memory allocated during the call: inputs and parameters are not counted, outputs are (they
    are alive at the end). On CPU the figure is the dispatch-mode tracking of :class:`StorageTracker`; on
    CUDA the caching allocator's peak, with the tracked figure reported beside it. The outputs are dropped.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Sigmoid()))
        >>> m = measure_peak(gm, torch.ones(1024))
        >>> m.peak_bytes, m.allocations, m.allocator_peak_bytes
        (8192, 2, None)
    """
    device = device_of(graph_module, (args, kwargs))
    gc.collect()  # garbage freed during the call would not be ours, but keep the allocator quiet
    allocator_peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad(), StorageTracker() as tracker:
        out = graph_module(*args, **kwargs)
        del out
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        allocator_peak = torch.cuda.max_memory_allocated(device) - before
    tracked = tracker.peak
    return PeakMeasurement(allocator_peak if allocator_peak is not None else tracked, tracked, allocator_peak,
                           tracker.allocations, device.type)
