"""The public entry points that wrap a model: ``optimize`` (function and decorator).

Example:
    >>> import torch, fxforge
    >>> opt = fxforge.optimize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.ones(2, 4),))
    >>> opt(torch.ones(2, 4)).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from fxforge.capture import normalize_inputs
from fxforge.rewrites.registry import resolve
from fxforge.runtime.native import OptimizedModule, optimize_class

TARGETS = ("native",)


def optimize(model: Any = None, example_inputs: Any = None, *, target: str = "native", rewrites: Any = "default",
             verify: bool = True, method: str = "auto") -> Any:
    """Capture, rewrite and run a model through fxforge.

    Three forms:

    - ``fxforge.optimize(model, example_inputs)`` returns an :class:`OptimizedModule` (an ``nn.Module``
      sharing the model's parameters); with example inputs it captures now, otherwise on the first call.
    - ``@fxforge.optimize`` on an ``nn.Module`` class: instances capture themselves on their first call.
    - ``@fxforge.optimize(target=..., rewrites=...)``: the same, with options.

    Args:
        model: an ``nn.Module`` instance or class (or None for the decorator-with-options form).
        example_inputs: a tuple of inputs, one tensor, or a dict of keyword inputs.
        target: ``"native"`` (run the rewritten graph with PyTorch).
        rewrites: ``"default"``, a list of built-in names, or pass objects.
        verify: check every rewrite numerically and roll back one that changes results.
        method: capture method, ``"auto"``, ``"fx"`` or ``"export"``.

    Raises:
        ValueError: an unknown target or rewrite name (checked before anything runs).

    Example:
        >>> @fxforge.optimize
        ... class Net(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x.relu()
        >>> Net()(-torch.ones(1)).tolist()
        [0.0]
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; available targets: {', '.join(TARGETS)}")
    resolve(rewrites)  # fail early on an unknown rewrite name
    options = {"rewrites": rewrites, "verify": verify, "method": method}
    if model is None:
        return functools.partial(optimize, example_inputs=example_inputs, target=target, **options)
    if isinstance(model, type) and issubclass(model, nn.Module):
        return optimize_class(model, **options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxforge.optimize takes an nn.Module instance or class, got {type(model).__name__}")
    optimized = OptimizedModule(model, **options)
    if example_inputs is not None:
        args, kwargs = normalize_inputs(example_inputs)
        optimized.prepare(*args, **kwargs)
    return optimized
