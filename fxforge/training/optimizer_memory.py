"""What an optimizer holds and allocates, found by running it on meta tensors (no memory, no compute).

:func:`optimizer_memory` builds the optimizer over meta copies of the trainable parameters (the same shapes
and dtypes, a meta gradient each), runs two steps (the first creates the state, as a real first step
does), and follows the second with the dispatch tracker of :mod:`fxforge.runtime.memory`: the state's bytes
per parameter, and the temporaries a step allocates and frees (AdamW's for-loop form computes
``sqrt(exp_avg_sq) / c`` one parameter at a time: twice the largest parameter; its ``foreach`` form, which
torch picks for CUDA tensors, a whole list at once).

Example:
    >>> params = [torch.nn.Parameter(torch.ones(1000, 100)), torch.nn.Parameter(torch.ones(100))]
    >>> mem = optimizer_memory(torch.optim.AdamW, params)
    >>> mem.state_bytes, round(mem.step_peak_bytes, -3)   # exp_avg and exp_avg_sq (plus a 4-byte step each); 2x400 kB
    (800808, 800000)

``torch.compiler.is_compiling()`` is one flag for the process: while another thread traces (dynamo, torch.export),
AdamW keeps its bias corrections as tensors, and the step's peak grows by a few bytes (16 for two parameters).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxforge.runtime.memory import StorageTracker

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
              "rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad, "none": None}
"""The optimizers the CLI names (``--optimizer adamw``); SGD gets ``lr=0.01, momentum=0.9``."""


def resolve_optimizer(optimizer: Any) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None:
    """An optimizer class, a factory ``params -> Optimizer``, a name from :data:`OPTIMIZERS`, or None.

    Example:
        >>> resolve_optimizer("adamw")([torch.nn.Parameter(torch.ones(1))]).__class__.__name__
        'AdamW'
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZERS)}")
        optimizer = OPTIMIZERS[key]
        if optimizer is None:
            return None
        if optimizer is torch.optim.SGD:
            return functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)  # picklable: workers get it
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("pass the optimizer's class or a factory params -> optimizer, not an instance")
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a class, a factory or a name, not {type(optimizer).__name__}")
    return optimizer


@dataclasses.dataclass(frozen=True)
class OptimizerMemory:
    """An optimizer's memory: ``state_bytes`` kept between steps (``state_by_param`` per parameter index)
    and ``step_peak_bytes``, the most its step allocates at once beyond the state.

    Example:
        >>> OptimizerMemory(8, 4, [8]).state_bytes
        8
    """

    state_bytes: int
    step_peak_bytes: int
    state_by_param: list[int]


def optimizer_memory(optimizer: Any, params: Sequence[torch.Tensor]) -> OptimizerMemory:
    """The state and step temporaries of ``optimizer`` over ``params`` (only their shapes, dtypes, devices).

    Frozen parameters (``requires_grad=False``) get no gradient, so the optimizer keeps no state for them,
    as in a real step. ``foreach`` is set as torch would choose it for the real devices (the list form on
    CUDA) when the optimizer is a class that takes it.

    Example:
        >>> optimizer_memory(None, [torch.nn.Parameter(torch.ones(4))]).state_bytes
        0
    """
    factory = resolve_optimizer(optimizer)
    if factory is None or not params:
        return OptimizerMemory(0, 0, [0] * len(params))
    metas = []
    for p in params:
        meta = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta", requires_grad=p.requires_grad)
        if p.requires_grad:
            meta.grad = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta")
        metas.append(meta)
    options: dict[str, Any] = {}
    if inspect.isclass(factory) and "foreach" in inspect.signature(factory).parameters:
        options["foreach"] = bool(params) and all(p.device.type == "cuda" for p in params)
    opt = factory(metas, **options)
    opt.step()
    with StorageTracker() as tracker:
        opt.step()
    by_param = []
    for meta in metas:
        state = opt.state.get(meta, {})
        seen: set[int] = set()
        total = 0
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    total += int(storage.nbytes())
        by_param.append(total)
    return OptimizerMemory(sum(by_param), tracker.peak, by_param)
