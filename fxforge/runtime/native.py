"""``OptimizedModule``: the model, run through its rewritten graphs, with the model's own state.

The module runs plans from a :class:`~fxforge.runtime.plans.PlanCache`; the plans themselves are built
by the function the native target hands in (:func:`fxforge.lowering.build.plan_builder`), which is what
:func:`fxforge.optimize` does.

Example:
    >>> import torch
    >>> from fxforge.lowering.build import plan_builder
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout()).eval()
    >>> opt = OptimizedModule(model, plan_builder(model))
    >>> opt(torch.ones(1, 3)).shape, list(opt.state_dict()) == list(model.state_dict())
    (torch.Size([1, 3]), True)
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from fxforge.capture import CaptureError
from fxforge.core.captured import Captured
from fxforge.core.follows import FollowsTraining
from fxforge.core.plan import Plan
from fxforge.core.report import Report
from fxforge.core.vocabulary import HOOK_DICTS
from fxforge.runtime.fallbacks import fallback_reason
from fxforge.runtime.plans import PlanBuilder, PlanCache, ShapePolicy

# (forward to run, why) -> a runner of the model through TorchDynamo, graph by graph
# (:class:`fxforge.runtime.dynamo.DynamoRunner`), which the target hands in.
DynamoFactory = Callable[[Callable[..., Any], str], Any]


def _clear_graphs_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """Plans may hold values derived from the old weights (folded convolutions): drop them."""
    cache = module.__dict__.get("_fxforge_cache")
    if cache is not None:
        cache.clear()
    runner = module.__dict__.get("_fxforge_dynamo")
    if runner is not None:
        runner.clear()


def uncapturable(error: BaseException) -> bool:
    """Whether a plan's build failed because no method captures the model as one graph (not because the model
    itself raised on the inputs): what TorchDynamo, cutting the model at its breaks, takes over.

    Example:
        >>> uncapturable(CaptureError("Net", {"fx": "x", "export": "y"})), uncapturable(ValueError())
        (True, False)
    """
    return isinstance(error, CaptureError) and "eager" not in error.reasons


def use_dynamo(holder: dict, cache: PlanCache, dynamo: DynamoFactory | None, method: str,
               forward: Callable[..., Any]) -> None:
    """Set up, in ``holder`` (a module's ``__dict__``), how TorchDynamo runs the model: from the start with
    ``method="dynamo"``, or once the model cannot be captured whole with ``method="auto"`` (the call that found
    it out runs through dynamo too)."""
    holder["_fxforge_dynamo"] = None
    if dynamo is None:
        return
    if method == "dynamo":
        holder["_fxforge_dynamo"] = dynamo(forward, "")
    elif method == "auto":
        def take_over(error: BaseException) -> bool:
            if not uncapturable(error):
                return False
            runner = holder["_fxforge_dynamo"] = dynamo(forward, fallback_reason(error, breaks=False))
            cache.eager = lambda *args, **kwargs: runner(args, kwargs)
            return True

        cache.divert = take_over


class OptimizedModule(nn.Module):
    """An ``nn.Module`` that runs ``model`` through fxforge's rewritten graphs.

    It shares the model's parameters, buffers and submodules (the same objects, under the same names:
    ``state_dict`` keys are the model's, so checkpoints load either way, and ``.to()``/``.train()``
    act on both; its ``training`` flag is the model's, so ``model.eval()`` is seen here too). It keeps one
    plan per input signature (shapes, strides, dtypes, devices, train/eval) and builds another on a new one;
    when capture fails it runs the model eagerly after one :class:`~fxforge.runtime.plans.FallbackWarning`.
    Attributes it does not have are looked up on the model (``opt.config`` for a transformers model).

    A model that no method captures as one graph (a branch on a tensor's value) runs through TorchDynamo instead,
    each graph between its breaks an optimized module of its own (:attr:`dynamo`, ``report.breaks``).

    Args:
        model: the module to run.
        build: ``(args, kwargs) -> Plan`` for ``model`` (:func:`fxforge.lowering.build.plan_builder`).
        policy: how plans treat input sizes.
        dynamo: ``(forward, why) -> DynamoRunner`` (the target's); None: a model that cannot be captured runs eagerly.
        method: ``"dynamo"``: graph by graph from the start; ``"auto"``: once capture fails; else never.

    Example:
        >>> from fxforge.lowering.build import plan_builder
        >>> relu = torch.nn.ReLU()
        >>> opt = OptimizedModule(relu, plan_builder(relu))
        >>> opt(-torch.ones(2)).tolist(), opt.report.method
        ([0.0, 0.0], 'fx')
        >>> _ = relu.train(); opt.training   # the model's own flag
        True
    """

    training = FollowsTraining(lambda self: self.__dict__.get("original"))

    def __init__(self, model: nn.Module, build: PlanBuilder, policy: ShapePolicy | None = None,
                 dynamo: DynamoFactory | None = None, method: str = "auto"):
        super().__init__()
        # Share the model's registries instead of registering it as a child: keys stay un-prefixed.
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["_modules"] = model._modules
        self.__dict__["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
        # ...and its forward and backward hooks: calling this module runs the model's hooks around the plan,
        # as calling the model would (torch's own __call__ does it, backward hooks included).
        for name in HOOK_DICTS:
            self.__dict__[name] = getattr(model, name)
        del self.__dict__["_is_full_backward_hook"]  # read from the model (through __getattr__)
        self.__dict__["original"] = model
        # The hooks ran around this module's forward already: where no plan serves, the model's forward runs.
        self.__dict__["_fxforge_cache"] = PlanCache(model, build, eager=lambda *a, **k: model.forward(*a, **k),
                                                    policy=policy)
        self.__dict__["_fxforge_method"] = (dynamo, method)
        use_dynamo(self.__dict__, self.cache, dynamo, method, model.forward)
        self.register_load_state_dict_post_hook(_clear_graphs_after_load)

    @property
    def dynamo(self) -> Any:
        """The :class:`~fxforge.runtime.dynamo.DynamoRunner` that runs the model graph by graph (``method="dynamo"``,
        or a model that cannot be captured whole with ``method="auto"``), or None."""
        return self.__dict__.get("_fxforge_dynamo")

    @property
    def cache(self) -> PlanCache:
        """The plans built so far, one per input signature."""
        return self.__dict__["_fxforge_cache"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runner = self.__dict__["_fxforge_dynamo"]
        return self.cache(args, kwargs) if runner is None else runner(args, kwargs)

    def prepare(self, *args: Any, **kwargs: Any) -> Captured | None:
        """Capture, rewrite and lower for these inputs now, without running: the plan for calls that record no
        gradients (under the autocast in force now); returns its ``Captured`` (or None). A model run through
        TorchDynamo runs once (its state left as it was) to build each graph's plan and measure its report's
        shares."""
        plan = self.cache.plan_for(args, kwargs) if self.dynamo is None else None
        if self.dynamo is not None:
            self.dynamo.prepare(args, kwargs)
        return plan.captured if plan is not None else None

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan | None:
        """The plan that runs for these inputs when no gradient is recorded (built now if needed), or None
        where the model runs eagerly."""
        return self.cache.plan_for(args, kwargs)

    def train(self, mode: bool = True) -> OptimizedModule:
        self.original.train(mode)  # (this module's flag is the model's)
        return self

    @property
    def plans_built(self) -> int:
        """How many plans were built (captures made) so far: one per input signature with ``dynamic=False``;
        with dynamic sizes, one more per dim that became dynamic, not one per size, and none for new sizes that
        a torch.fx plan serves once checked against eager (``cache.plans_reused`` counts those).

        Example:
            >>> opt = fxforge.optimize(torch.nn.Linear(2, 2))
            >>> with torch.no_grad():
            ...     _ = [opt(torch.ones(n, 2)) for n in (2, 3, 4, 5)]
            >>> opt.plans_built, opt.cache.plans_reused   # sizes 2 (its plan), then 3, 4 and 5 served by it
            (1, 3)
        """
        return self.cache.plans_built if self.dynamo is None else self.dynamo.plans_built

    @property
    def captured(self) -> Captured | None:
        """The most recently prepared graph, with its report."""
        return self.cache.captured

    @property
    def report(self) -> Report | None:
        """The report of the most recently prepared graph; where no graph was prepared because the model runs
        eagerly, a report with ``method="eager"`` whose notes say why; None before the first call.

        Example:
            >>> class Raises(torch.nn.Module):
            ...     def forward(self, x):
            ...         raise ValueError("no graph here")
            >>> opt = fxforge.optimize(Raises())
            >>> opt.report is None
            True
        """
        if self.dynamo is not None:
            report = self.dynamo.report  # made on each read: target="auto"'s race (this module won it) kept on it
            report.race = self.__dict__.get("race")
            return report
        if self.cache.captured is not None:
            return self.cache.captured.report
        if self.cache.fallbacks:
            return Report(method="eager", notes=list(self.cache.fallbacks))
        return None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("original")
            if original is None:
                raise
            return getattr(original, name)

    def extra_repr(self) -> str:
        return f"model={type(self.original).__name__}, plans={len(self.cache.plans)}"

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Copies (``copy.deepcopy``, ``pickle``, ``torch.save``) are a new optimized module over a copy of the
        model, with the same options and no plans: plans hold prepacked kernels and locks, and a copy's plans
        are built from the copy's own weights on its first call.

        Example:
            >>> import copy
            >>> model = torch.nn.Linear(2, 2)
            >>> twin = copy.deepcopy(fxforge.optimize(model))
            >>> twin.original is not model, twin.weight is twin.original.weight
            (True, True)
        """
        return OptimizedModule, (self.original, self.cache.build, self.cache.policy, *self.__dict__["_fxforge_method"])


def optimize_class(cls: type[nn.Module], builder_for: Callable[[nn.Module], PlanBuilder],
                   policy: ShapePolicy | None = None, dynamo: DynamoFactory | None = None,
                   method: str = "auto") -> type[nn.Module]:
    """A subclass of ``cls`` whose instances capture and rewrite themselves on their first call.

    The subclass keeps the class's name, module and docstring; instances are ordinary instances of
    ``cls`` (same attributes, same ``state_dict``), with a per-instance plan cache and ``report``.

    Args:
        cls: the ``nn.Module`` class.
        builder_for: ``instance -> (args, kwargs) -> Plan`` (:func:`fxforge.lowering.build.plan_builder`).
        policy: how the instances' plans treat input sizes (:class:`~fxforge.runtime.plans.ShapePolicy`).

    Example:
        >>> from fxforge.lowering.build import plan_builder
        >>> Fast = optimize_class(torch.nn.Linear, plan_builder)
        >>> layer = Fast(2, 2)
        >>> isinstance(layer, torch.nn.Linear), layer(torch.ones(1, 2)).shape
        (True, torch.Size([1, 2]))
    """
    eager_forward = cls.forward

    # functools.wraps keeps the user's signature visible (fx reads it through __wrapped__).
    @functools.wraps(eager_forward)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if type(self).forward is not forward:
            # A subclass with a forward of its own reached this one through super(): the plan would run the
            # subclass's forward too, so this one runs as written.
            return eager_forward(self, *args, **kwargs)
        cache = self.__dict__.get("_fxforge_cache")
        if cache is None:
            cache = PlanCache(self, builder_for(self), eager=lambda *a, **k: eager_forward(self, *a, **k),
                              policy=policy)
            self.__dict__["_fxforge_cache"] = cache
            use_dynamo(self.__dict__, cache, dynamo, method, types.MethodType(eager_forward, self))
        runner = self.__dict__["_fxforge_dynamo"]
        return cache(args, kwargs) if runner is None else runner(args, kwargs)

    def fxforge_report(self) -> Report | None:
        cache, runner = self.__dict__.get("_fxforge_cache"), self.__dict__.get("_fxforge_dynamo")
        if runner is not None:
            return runner.report
        return cache.captured.report if cache is not None and cache.captured is not None else None

    def __getstate__(self):
        state = (super(optimized, self).__getstate__() if hasattr(super(optimized, self), "__getstate__")
                 else self.__dict__).copy()
        state.pop("_fxforge_cache", None)
        state.pop("_fxforge_dynamo", None)
        return state

    original_init = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.register_load_state_dict_post_hook(_clear_graphs_after_load)

    optimized = decorated_subclass(cls, {
        "forward": forward,
        "fxforge_report": property(fxforge_report, doc="What fxforge did to this instance's latest graph."),
        "__getstate__": __getstate__,
        "__init__": __init__,
    })
    return optimized


def decorated_subclass(cls: type, members: dict[str, Any]) -> type:
    """``cls`` subclassed with ``members`` (its new ``forward``, properties...), keeping its name, module,
    qualified name and docstring; ``report`` is ``fxforge_report`` unless the class has a ``report`` of its own.

    Example:
        >>> class Net(torch.nn.Module):
        ...     "My net."
        >>> sub = decorated_subclass(Net, {"fxforge_report": property(lambda self: "r")})
        >>> sub.__name__, sub.__doc__, sub().report
        ('Net', 'My net.', 'r')
    """
    namespace = {**members, "__doc__": cls.__doc__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if not hasattr(cls, "report"):
        namespace["report"] = namespace["fxforge_report"]
    return type(cls.__name__, (cls,), namespace)
