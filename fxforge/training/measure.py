"""One real training step, measured phase by phase: the figures :class:`TrainingMemory` predicts.

:func:`measure_step` runs a warm-up step (the optimizer creates its state there, as on any first step), then
one measured step ``loss(model(*args, **kwargs)).backward(); optimizer.step(); optimizer.zero_grad()``, and
restores the parameters, buffers and gradients it found, so measuring does not train the model. The bytes
come from the allocator, above what was allocated when the step began: on CPU its own records of every
allocation and free (:mod:`fxforge.runtime.allocator`, through ``torch.profiler``: they include the copies
kernels make inside themselves, which a dispatch mode does not see), on CUDA the caching allocator's
statistics (``max_memory_allocated`` per phase).

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    >>> m = measure_step(model, (torch.randn(32, 64),), {}, optimizer=torch.optim.SGD)
    >>> m.saved_bytes, m.gradient_bytes, m.optimizer_state_bytes   # SGD without momentum keeps nothing
    (8192, 16900, 0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterable
from typing import Any

import torch

from fxforge.core.memory import tensor_leaves
from fxforge.runtime.allocator import AllocatorRecords, Phase
from fxforge.training.optimizer_memory import resolve_optimizer
from fxforge.training.step_graph import LossFn, default_loss


def unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights and views counted once).

    Example:
        >>> w = torch.ones(4)
        >>> unique_bytes([w, w.view(2, 2), torch.ones(2)])
        24
    """
    storages = {}
    for tensor in tensors:
        storage = _storage(tensor)
        if storage is not None:
            storages[storage._cdata] = int(storage.nbytes())
    return sum(storages.values())


def _storage(tensor: torch.Tensor) -> Any:
    try:
        return tensor.untyped_storage()
    except Exception:  # noqa: BLE001 - no storage (sparse, nested): nothing to count
        return None


@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """A measured training step; every figure in bytes.

    Attributes:
        weights_bytes, buffers_bytes, inputs_bytes, optimizer_state_bytes: what exists when the step begins.
        saved_bytes: activations alive after the forward, the loss aside (what autograd saved).
        gradient_bytes: the parameters' gradients after the backward.
        forward_peak_bytes, backward_peak_bytes, optimizer_peak_bytes: the most alive at once in each
            phase, everything that existed when the step began included.
        peak_bytes: the step's peak (the largest of the three).
        device: ``"cpu"`` (the CPU allocator's records) or ``"cuda"`` (the caching allocator).
    """

    weights_bytes: int
    buffers_bytes: int
    inputs_bytes: int
    optimizer_state_bytes: int
    saved_bytes: int
    gradient_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    peak_bytes: int
    device: str

    @property
    def persistent_bytes(self) -> int:
        """Weights, buffers, inputs and optimizer state: alive through the whole step."""
        return self.weights_bytes + self.buffers_bytes + self.inputs_bytes + self.optimizer_state_bytes

    @property
    def activation_peak_bytes(self) -> int:
        """The most alive at once in forward and backward beyond the persistent bytes and the gradients
        (bounded by the gradients' growth: a figure for the budget, not a lone exact measurement)."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes) - self.persistent_bytes


def _device(model: torch.nn.Module, values: Any) -> torch.device:
    for t in [*tensor_leaves(values), *model.parameters()]:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


class PhaseMeter:
    """Per-phase peaks and held bytes above the start: the CPU allocator's records (through the profiler) on
    CPU, the caching allocator's statistics on CUDA. :meth:`end` closes a phase; :meth:`phases` reads them
    all once the meter has exited.

    Example:
        >>> with PhaseMeter(torch.device("cpu")) as meter:
        ...     x = torch.ones(1024)
        ...     meter.end("forward")
        >>> meter.phases()["forward"].peak_bytes >= 4096
        True
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.records = AllocatorRecords() if device.type == "cpu" else None
        self.order: list[str] = []
        self.cuda: dict[str, Phase] = {}
        self.base = 0

    def __enter__(self) -> PhaseMeter:  # noqa: PYI034 - never subclassed
        if self.records is not None:
            self.records.__enter__()
        else:
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.records is not None:
            self.records.__exit__(*exc)

    def end(self, phase: str) -> None:
        """The phase ``phase`` ends here."""
        self.order.append(phase)
        if self.records is not None:
            self.records.mark(phase)
            return
        torch.cuda.synchronize(self.device)
        self.cuda[phase] = Phase(torch.cuda.max_memory_allocated(self.device) - self.base,
                                 torch.cuda.memory_allocated(self.device) - self.base)
        torch.cuda.reset_peak_memory_stats(self.device)

    def phases(self) -> dict[str, Phase]:
        return self.records.phases(self.order) if self.records is not None else self.cuda


@contextlib.contextmanager
def restored(model: torch.nn.Module):
    """Within it the model may train; on exit its parameters, buffers and gradients are as they were."""
    params = [(p, p.detach().clone(), p.grad) for p in model.parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value, grad in params:
                p.copy_(value)
                p.grad = grad
            for b, value in buffers:
                b.copy_(value)


def measure_step(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                 loss: LossFn | None = default_loss, optimizer: Any = torch.optim.AdamW,
                 autocast: torch.dtype | None = None) -> StepMeasurement:
    """Run one warm-up and one measured training step of ``model`` and return the measured figures.

    The model is left as it was (parameters, buffers and gradients restored). See the module docstring.

    Example:
        >>> m = measure_step(torch.nn.Linear(256, 256), (torch.randn(64, 256),), {}, optimizer=None)
        >>> m.gradient_bytes, m.saved_bytes
        (263168, 0)
    """
    loss = loss or default_loss
    factory = resolve_optimizer(optimizer)
    device = _device(model, (args, kwargs))
    trainable = [p for p in model.parameters() if p.requires_grad]
    amp = (lambda: torch.autocast(device.type, dtype=autocast)) if autocast is not None else contextlib.nullcontext

    def run(meter: PhaseMeter | None, opt: torch.optim.Optimizer | None) -> dict[str, int]:
        with amp():
            value = loss(model(*args, **kwargs))
        sizes = {"loss": unique_bytes([value])}
        if meter is not None:
            meter.end("forward")
        value.backward()
        del value
        if meter is not None:
            meter.end("backward")
            sizes["gradients"] = unique_bytes(p.grad for p in trainable if p.grad is not None)
        if opt is not None:
            opt.step()
        if meter is not None:
            meter.end("optimizer")
        for p in trainable:
            p.grad = None
        return sizes

    with restored(model):
        for p in trainable:
            p.grad = None
        opt = factory(trainable) if factory is not None else None
        run(None, opt)  # the first step creates the optimizer's state
        gc.collect()
        state = [t for s in (opt.state.values() if opt is not None else ()) for t in s.values()
                 if isinstance(t, torch.Tensor)]
        persistent = {
            "weights": unique_bytes(model.parameters()),
            "buffers": unique_bytes(model.buffers()),
            "inputs": unique_bytes(tensor_leaves((args, kwargs))),
            "state": unique_bytes(state),
        }
        with PhaseMeter(device) as meter:
            sizes = run(meter, opt)
    measured = meter.phases()
    # Both allocators' figures are above what was allocated when the step began: the persistent set.
    base = sum(persistent.values())
    peaks = {k: base + measured[k].peak_bytes for k in ("forward", "backward", "optimizer")}
    saved = measured["forward"].held_bytes - sizes["loss"]
    return StepMeasurement(persistent["weights"], persistent["buffers"], persistent["inputs"], persistent["state"],
                           saved, sizes["gradients"], peaks["forward"], peaks["backward"],
                           peaks["optimizer"], max(peaks.values()), device.type)
