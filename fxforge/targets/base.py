"""What a target is: its options, its contract (what it serves), how it builds and writes.

Every target is one module of :mod:`fxforge.targets` holding one :class:`Target`; ``TARGETS`` lists them.
``fxforge.optimize``, the CLI, a checkpointed training step and ``target="auto"``'s race look a target up
there and ask it, never its name:

- :attr:`Target.options`: the options it takes besides the common ones (:data:`COMMON_OPTIONS`), checked
  once by :meth:`Target.check`;
- :attr:`Target.contract`: what it serves (:class:`Contract`);
- :meth:`Target.build`: the module for a model instance (prepared for the example inputs when given) or a
  decorated subclass for a class;
- :meth:`Target.graph`: the rewritten graph what it built runs;
- :meth:`Target.write`: an artifact of what it built (a ``.pt2``, an ``.onnx``), where it has one;
- :meth:`Target.checkpointed`: a training step fitted under a memory budget, where it runs one;
- :meth:`Target.entrant`: how ``target="auto"`` builds it in its race.

Example:
    >>> class Echo(Target):
    ...     name, summary = "echo", "runs the model as it is"
    ...     contract = Contract(dynamic="every size", artifact=None)
    ...     def build(self, model, example_inputs, options):
    ...         return model
    >>> Echo().check({"rewrites": "default"})
    {'rewrites': 'default'}
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from torch import nn

from fxforge.runtime.race import Entrant

# Options every target takes (fxforge.optimize's own keywords).
COMMON_OPTIONS = ("rewrites", "verify", "method", "dynamic")


@dataclasses.dataclass(frozen=True)
class Contract:
    """What a target serves: the promises its module keeps, which ``target="auto"`` and the CLI read.

    Attributes:
        dynamic: how it meets sizes other than the example's (a sentence: "every size: a new plan per
            size, or one with the dims that changed dynamic").
        live_weights: it reads the model's parameters and buffers as they are at each call (False: a
            snapshot taken when it was built).
        hooks: the model's forward hooks run around it.
        gradients: calls that record gradients get eager's gradients.
        training: it serves the model in training mode (False: an inference snapshot; auto does not race it
            for a model in training mode).
        artifact: the suffix of the file :meth:`Target.write` writes (``".pt2"``, ``".onnx"``), or None.
        devices: where it runs.
        decorates: ``@fxforge.optimize(target=...)`` works on a class.
        raced: ``target="auto"`` races it.

    Example:
        >>> Contract(dynamic="every size", artifact=".pt2").describe()
        'every size; live weights; hooks; gradients; training mode; writes .pt2; on CPU and CUDA'
    """

    dynamic: str
    live_weights: bool = True
    hooks: bool = True
    gradients: bool = True
    training: bool = True
    artifact: str | None = None
    devices: str = "CPU and CUDA"
    decorates: bool = True
    raced: bool = True

    def describe(self) -> str:
        """One line: what it serves."""
        parts = [self.dynamic, "live weights" if self.live_weights else "a snapshot of the weights",
                 "hooks" if self.hooks else "no hooks", "gradients" if self.gradients else "no gradients",
                 "training mode" if self.training else "eval mode only",
                 f"writes {self.artifact}" if self.artifact else "no file", f"on {self.devices}"]
        return "; ".join(parts)


class Target(abc.ABC):
    """One way to run a model, behind the one protocol every target follows (see the module docstring).

    Subclasses set :attr:`name`, :attr:`summary`, :attr:`contract`, :attr:`options` and implement
    :meth:`build`; :meth:`write`, :meth:`checkpointed` and :meth:`entrant` have defaults.

    Example:
        >>> from fxforge.targets import TARGETS
        >>> TARGETS["native"].contract.artifact, TARGETS["onnxruntime"].contract.live_weights
        ('.pt2', False)
    """

    name: str = ""
    summary: str = ""
    contract: Contract
    options: tuple[str, ...] = ()
    # The reduced precisions this target runs, each as ``precision=`` it takes (``"auto"``: it races its own);
    # ``target="auto"`` passes a raced target the user's precision where it is here, and for ``"auto"`` the
    # target's one reduced precision where it has only one (none: the target runs float32).
    precisions: tuple[str, ...] = ()

    def precision_for(self, precision: str) -> str | None:
        """What this target is given of the user's ``precision`` when raced (None: it runs float32).

        Example:
            >>> from fxforge.targets import TARGETS
            >>> [TARGETS[t].precision_for("auto") for t in ("native", "onnxruntime", "inductor")]
            ['auto', 'int8', 'auto']
            >>> TARGETS["inductor"].precision_for("bf16") is None
            True
        """
        if precision in self.precisions:
            return precision
        if precision == "auto" and len(self.precisions) == 1:
            return self.precisions[0]
        return None

    def check(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` (common ones and this target's) checked once, before anything runs; returns them.

        Raises:
            TypeError: an option this target does not take, or ``dynamic`` not None/True/False.
        """
        unknown = sorted(set(options) - set(COMMON_OPTIONS) - set(self.options))
        if unknown:
            raise TypeError(f"target {self.name!r} does not take {', '.join(unknown)}; it takes "
                            f"{', '.join(self.options) or 'no options of its own'}")
        if options.get("dynamic") not in (None, True, False):
            raise TypeError(f"dynamic takes None, True or False, got {options['dynamic']!r}")
        return options

    @abc.abstractmethod
    def build(self, model: Any, example_inputs: Any, options: dict[str, Any]) -> nn.Module | type:
        """The optimized module for an ``nn.Module`` instance (prepared for ``example_inputs`` when given), or a
        subclass for an ``nn.Module`` class. ``options`` were checked by :meth:`check`."""

    def graph(self, built: nn.Module) -> Any:
        """The rewritten :class:`~fxforge.core.captured.Captured` that ``built`` runs (its ``before``: the graph
        as captured), or None where it has none yet."""
        return getattr(built, "captured", None)

    def write(self, built: nn.Module, path: str, *, dynamic_batch: bool = False) -> Any:
        """Write what :meth:`build` returned as a file at ``path`` (whole or not at all); returns what was
        written, with its ``validation`` (max abs error per input set).

        Raises:
            TypeError: this target writes no file.
        """
        raise TypeError(f"target {self.name!r} writes no file: use a target whose artifact is .pt2 or .onnx")

    def checkpointed(self, model: Any, example_inputs: Any, memory_budget: Any, **options: Any) -> nn.Module:
        """The model's training step fitted under ``memory_budget`` by checkpointing, run by this target.

        Raises:
            TypeError: this target does not run checkpointed training steps.
        """
        raise TypeError(f"memory_budget plans checkpointing for a training step, which target={self.name!r} does "
                        "not run; use target='native' or 'inductor'")

    def entrant(self, model: nn.Module, args: tuple, kwargs: dict, options: dict[str, Any],
                shared: dict[str, Any]) -> Entrant:
        """How ``target="auto"`` builds this target in its race (``shared``: what entrants tell each other,
        such as the native graph's size for Inductor's compile estimate)."""
        return Entrant(self.name, lambda: prepared(self.build(model, None, options), args, kwargs))


def prepared(module: Any, args: tuple, kwargs: dict) -> nn.Module:
    """``module`` prepared (captured, rewritten, lowered or exported) for these inputs, without running.

    Example:
        >>> from fxforge.targets import TARGETS
        >>> relu = torch.nn.ReLU()
        >>> prepared(TARGETS["native"].build(relu, None, {}), (torch.ones(2),), {}).report.method
        'fx'
    """
    module.prepare(*args, **kwargs)
    return module


def model_kind(model: Any) -> str:
    """``"class"`` for an ``nn.Module`` subclass, ``"instance"`` for an instance.

    Raises:
        TypeError: neither.

    Example:
        >>> model_kind(torch.nn.ReLU), model_kind(torch.nn.ReLU())
        ('class', 'instance')
    """
    if isinstance(model, type) and issubclass(model, nn.Module):
        return "class"
    if isinstance(model, nn.Module):
        return "instance"
    raise TypeError(f"fxforge.optimize takes an nn.Module instance or class, got {type(model).__name__}")
