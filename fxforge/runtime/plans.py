"""One plan per input signature, built on first sight, eager when building fails; run per call.

A :class:`PlanCache` is the per-call half of an optimized module: it finds the plan for a call's input
signature (:func:`~fxforge.runtime.signature.input_signature`), drops plans the model's state has
outgrown, runs the right graph of the plan (the lowered one without gradients, the rewritten one with
them), and falls back to the model's own forward, after one warning, when no plan can be built. Building
a plan (capture -> rewrite -> lower) is the orchestrator's job: :mod:`fxforge.planner` hands its build
function in, so nothing here imports the stages that make plans.

Example:
    >>> import torch
    >>> from fxforge.planner import plan_builder
    >>> relu = torch.nn.ReLU()
    >>> cache = PlanCache(relu, plan_builder(relu))
    >>> cache((torch.ones(2),), {}).tolist()
    [1.0, 1.0]
    >>> len(cache.plans)
    1
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from fxforge.core.captured import Captured
from fxforge.core.plan import Plan
from fxforge.core.source import first_line
from fxforge.runtime.signature import describe_signature, input_signature

# (args, kwargs) -> the plan for calls like this one; raises when the module cannot be captured.
PlanBuilder = Callable[[tuple, dict], Plan]


class FallbackWarning(UserWarning):
    """fxforge could not capture a model for some inputs and runs it eagerly instead."""


class PlanCache:
    """Plans for ``module`` per input signature, built by ``build`` on first sight and run for each call.

    Thread-safe: concurrent first calls build one plan (the others wait for it); a call from inside the
    build (a decorated class's forward, run by capture) runs eagerly.

    Args:
        module: the model (its mode at call time is part of the signature).
        build: ``(args, kwargs) -> Plan`` (see :func:`fxforge.planner.plan_builder`).
        eager: what runs when no plan can be built (default: the module).

    Example:
        >>> from fxforge.planner import plan_builder
        >>> linear = torch.nn.Linear(2, 2)
        >>> cache = PlanCache(linear, plan_builder(linear))
        >>> _ = cache((torch.ones(1, 2),), {}); cache.last.captured.method
        'fx'
    """

    def __init__(self, module: nn.Module, build: PlanBuilder, eager: Callable[..., Any] | None = None):
        self.module = module
        self.build = build
        self.eager = eager if eager is not None else module
        self.plans: dict[Hashable, Plan | None] = {}
        self.last: Plan | None = None
        self._state: list[torch.Tensor] | None = None  # parameters and buffers, to watch for changes
        self._versions: tuple[int, ...] = ()
        self._eval_keys: set[Hashable] = set()
        self._trained = False
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self._building = threading.local()

    @property
    def capturing(self) -> bool:
        """Whether this thread is inside this cache's build (a call made there must run eagerly)."""
        return getattr(self._building, "active", False)

    def plan_for(self, args: tuple, kwargs: dict) -> Plan | None:
        """The plan for this call's signature, built now if there is none yet.

        Returns None, after one warning per distinct reason, when the module cannot be captured.
        """
        training = self.module.training
        key = input_signature(args, kwargs, training)
        with self._lock:
            if training:
                self._trained = True
            else:
                self._drop_stale_eval_plans()
            if key in self.plans:
                return self.plans[key]
            self._building.active = True
            try:
                plan = self.build(args, kwargs)
            except Exception as error:  # noqa: BLE001 - any failure falls back to eager with a warning
                self._warn(args, kwargs, error)
                self.plans[key] = None
                return None
            finally:
                self._building.active = False
            self.plans[key] = plan
            if not training:
                self._eval_keys.add(key)
                self._versions = tuple(t._version for t in self._watched())
            self.last = plan
            return plan

    def _warn(self, args: tuple, kwargs: dict, error: Exception) -> None:
        reason = first_line(error) if not str(error).startswith("cannot capture") else str(error)
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(
                f"fxforge: running {type(self.module).__name__} eagerly for inputs "
                f"{describe_signature(args, kwargs)}: {reason}",
                FallbackWarning,
                stacklevel=5,
            )

    def _watched(self) -> list[torch.Tensor]:
        """The module's parameters and buffers (listed once; ``clear()`` lists them again)."""
        if self._state is None:
            self._state = [*self.module.parameters(), *self.module.buffers()]
        return self._state

    def _drop_stale_eval_plans(self) -> None:
        """Eval plans hold values computed from the weights (folded BatchNorm, prepacked convolutions):
        drop them when a parameter or buffer changed in place, or after a training-mode call (BatchNorm
        updates its statistics without marking the tensors changed)."""
        versions = tuple(t._version for t in self._watched())
        if (self._trained or versions != self._versions) and self._eval_keys:
            for key in self._eval_keys:
                self.plans.pop(key, None)
            self._eval_keys.clear()
        self._versions, self._trained = versions, False

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if self.capturing:
            return self.eager(*args, **kwargs)
        plan = self.plan_for(args, kwargs)
        if plan is None:
            return self.eager(*args, **kwargs)
        if self._needs_grad(args, kwargs):
            return plan.captured.graph_module(*args, **kwargs)  # fused custom ops carry autograd
        return plan.executable(*args, **kwargs)

    def _needs_grad(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call records gradients (the lowered graph's fused kernels have no autograd)."""
        if not torch.is_grad_enabled():
            return False
        if any(t.requires_grad for t in self._watched()):
            return True
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)

    @property
    def captured(self) -> Captured | None:
        """The most recently built plan's rewritten graph."""
        return self.last.captured if self.last is not None else None

    def clear(self) -> None:
        """Forget every plan (after new weights are loaded, or the module changed)."""
        with self._lock:
            self.plans.clear()
            self._eval_keys.clear()
            self._state = None
            self.last = None
