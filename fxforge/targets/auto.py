"""The ``auto`` target: the fastest of the other targets and eager for this model on this machine.

Every raced target (those of ``TARGETS`` whose contract says ``raced``, or the caller's ``targets=``) is built,
run on fresh inputs and compared with eager, then timed together with eager
(:func:`fxforge.runtime.race.race`); the fastest is returned, its report's ``race`` holding every
contender's latency, ratio to eager, prepare time and error (eager's line first), every refused contender's
reason, and why the winner won.

A target enters the race only if it serves every input the native plan serves: the race finds the input
dims eager serves at other sizes (:func:`fxforge.runtime.served.new_sizes`), ONNX Runtime's file is exported
with those dims dynamic, and it is checked on inputs of those new sizes (refused, with the reason, where it
does not serve them); keyword inputs reach every target. Eager is a contender: when no target beats eager by
more than the race's tie, auto says so (the race's ``why`` and a :class:`~fxforge.runtime.race.RaceWarning`)
and returns the model itself, wrapped (:class:`EagerModule`): rather than the fastest plan, since that plan
was measured slower than the model as it is, and the model itself keeps every promise (live weights, every
size). Unless ``targets=`` names them, a target whose build is expected to take longer than
:data:`~fxforge.runtime.race.PAYBACK_CALLS` eager calls (Inductor's compile for a model whose eager call
takes a millisecond) is skipped, with that reason: it could not pay its build back. Every step is logged
(logger ``"fxforge"``, INFO) and shown as a status line on a terminal (:mod:`fxforge.runtime.progress`). A near tie goes to the target whose contract
promises more (live weights and PyTorch's own autograd first). The choice is remembered on disk
(:mod:`fxforge.core.target_cache`): the next optimize of a model of the same structure with inputs of the
same signature on this machine builds only the winner, re-times it against eager, and races everything
again only when that contradicts the remembered speed-up (by :data:`CONTRADICTED`) or the winner no longer
builds or agrees. A model in training mode does not race a target whose contract does not serve training
mode (an ONNX export is an inference snapshot).

Example:
    >>> from fxforge.targets import TARGETS
    >>> net = TARGETS["auto"].build(torch.nn.Linear(8, 8).eval(), (torch.ones(4, 8),), {"targets": ["native"]})
    >>> [c.target for c in net.report.race.contenders]
    ['eager', 'native']
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from fxforge.capture import normalize_inputs
from fxforge.core.accuracy import Tolerance
from fxforge.core.follows import FollowsTraining
from fxforge.core.report import Contender, Race, Report
from fxforge.core.target_cache import choice_key, target_cache
from fxforge.lowering.precision_stage import precision_dtype
from fxforge.rewrites.registry import resolve
from fxforge.runtime.progress import step
from fxforge.runtime.race import RaceWarning, race, remembrable
from fxforge.runtime.served import new_sizes
from fxforge.targets.base import COMMON_OPTIONS, Contract, Target, model_kind, prepared

# Seconds the race may take by default (Inductor's compile is skipped when it would not fit).
AUTO_BUDGET_S = 300.0
# A remembered winner re-timed against eager is raced again when its speed-up over eager fell by this factor.
CONTRADICTED = 1.5


class AutoTarget(Target):
    """Races the targets of ``registry`` (see the module docstring).

    Args:
        registry: the targets by name (``fxforge.targets.TARGETS``, which holds this one too), read when a
            race starts: those whose contract says ``raced``, in their order there (the order built).
    """

    name = "auto"
    summary = "the fastest of the raced targets, measured on the example inputs"
    contract = Contract(dynamic="what the winner serves", artifact=None, decorates=False, raced=False)
    options = ("targets", "budget_s", "max_plans", "precision", "tolerance")

    def __init__(self, registry: Mapping[str, Target]):
        self.registry = registry

    def raced(self) -> tuple[Target, ...]:
        """The targets raced by default, in the order built."""
        return tuple(t for t in self.registry.values() if t.contract.raced)

    def preference(self) -> tuple[str, ...]:
        """The raced targets in the order a near tie is settled: live weights, gradients and training mode
        first, then a target that writes a file, then the order built.

        Example:
            >>> from fxforge.targets import TARGETS
            >>> TARGETS["auto"].preference()
            ('native', 'inductor', 'onnxruntime')
        """
        def rank(target: Target) -> tuple:
            c = target.contract
            return (not c.live_weights, not c.gradients, not c.training, c.artifact is None)
        return tuple(t.name for t in sorted(self.raced(), key=rank))

    def check(self, options: dict[str, Any]) -> dict[str, Any]:
        options = super().check(options)
        targets = options.get("targets")
        if targets is not None:
            names = [t.name for t in self.raced()]
            if not list(targets) or any(t not in names for t in targets):
                raise ValueError(f"targets= takes a non-empty list of {', '.join(names)}; got {list(targets)!r}")
        return options

    def build(self, model: Any, example_inputs: Any, options: dict[str, Any]) -> nn.Module:
        if model_kind(model) == "class":
            raise TypeError("target='auto' races the targets on example inputs: call fxforge.optimize(model, "
                            "example_inputs, target='auto') on a model instance, not as a decorator")
        if example_inputs is None:
            raise TypeError("target='auto' needs example_inputs to race the targets on")
        return self._race(model, example_inputs, dict(options))

    def graph(self, built: nn.Module) -> Any:
        if isinstance(built, EagerModule):
            fastest = built.built_fastest()
            return self.registry[built.fastest_target].graph(fastest) if fastest is not None else None
        return self.registry[built.race.winner].graph(built)

    def write(self, built: nn.Module, path: str, *, dynamic_batch: bool = False) -> Any:
        """The winner's file; where eager won, the fastest target's (what it would have run)."""
        if isinstance(built, EagerModule):
            fastest = built.built_fastest()
            if fastest is None:
                raise TypeError("nothing to write: target='auto' chose eager and no target was built")
            return self.registry[built.fastest_target].write(fastest, path, dynamic_batch=dynamic_batch)
        return self.registry[built.race.winner].write(built, path, dynamic_batch=dynamic_batch)

    def _race(self, model: nn.Module, example_inputs: Any, options: dict[str, Any]) -> nn.Module:
        began = time.perf_counter()
        args, kwargs = normalize_inputs(example_inputs)
        chosen = options.pop("targets", None)
        targets = tuple(chosen or (t.name for t in self.raced()))
        budget_s = options.pop("budget_s", AUTO_BUDGET_S)
        precision, tolerance = options.pop("precision", "float32"), options.pop("tolerance", None)
        reduced = precision_dtype(precision) is not None
        tolerance = Tolerance.of(tolerance) if reduced else None
        common = {k: options.get(k, default) for k, default in
                  (("rewrites", "default"), ("verify", True), ("method", "auto"), ("dynamic", None))}
        names = [getattr(p, "name", repr(p)) for p in resolve(common["rewrites"])]
        key = choice_key(model, args, kwargs, f"targets {sorted(targets)} rewrites {names} verify {common['verify']} "
                                              f"method {common['method']} dynamic {common['dynamic']}"
                                              + (f" precision {precision} {tolerance}" if reduced else ""))
        cache = target_cache()
        stored = cache.get(key) if cache is not None else None
        shared: dict[str, Any] = {}
        entrants = {t.name: t.entrant(model, args, kwargs, {**{k: v for k, v in options.items()
                                                               if k in COMMON_OPTIONS or k in t.options},
                                                            **_precision_options(t, precision, tolerance)}, shared)
                    for t in self.raced() if t.name in targets}
        preference = self.preference()
        notes: list[str] = []
        if stored is not None and stored.get("winner") == "eager" and stored.get("fastest") in entrants:
            module = _remembered_eager(model, entrants[stored["fastest"]], stored)
            _warn_eager(model, module.race.why)
            return module
        if stored is not None and stored.get("winner") in entrants:
            winner = stored["winner"]
            served = self._served(model, args, kwargs, [entrants[winner]], shared)
            built, result = race(model, args, kwargs, [entrants[winner]], budget_s=None, began=began,
                                 preference=preference, served=served, tolerance=tolerance)
            then = stored["eager_ms"] / stored["latency_ms"][winner]
            timed = next((c for c in result.contenders if c.target == winner), None)
            now = result.eager_ms / timed.latency_ms if result.winner and timed and timed.latency_ms else None
            if now is not None and then / now <= CONTRADICTED and result.winner == winner:
                return _chosen(built[winner], _remembered(result, stored, then, now))
            notes.append(f"the remembered choice {winner} ({then:.2f}x eager when chosen) was raced again: "
                         + (f"it ran at {now:.2f}x eager now" if now is not None else timed.refused))
        snapshots = [name for name in entrants if model.training and not self.registry[name].contract.training]
        racing = [e for name, e in entrants.items() if name not in snapshots]
        served = self._served(model, args, kwargs, racing, shared)
        built, result = race(model, args, kwargs, racing, budget_s=budget_s, began=began, preference=preference,
                             served=served, payback=chosen is None, tolerance=tolerance)
        for name in snapshots:
            result.contenders.append(Contender(name, refused="not raced: the model is in training mode (it runs "
                                                             "an inference snapshot)"))
        result.notes[:0] = notes
        if not result.winner:
            fallback = self.raced()[0]  # the first raced target, without rewrites
            own = {k: v for k, v in options.items() if k in fallback.options}
            module = prepared(fallback.build(model, None, {**common, **own, "rewrites": []}), args, kwargs)
            result.winner, result.why = fallback.name, f"no target agreed with eager: {fallback.name} without rewrites"
            return _chosen(module, result)
        fastest = min((c for c in result.contenders if c.target in built and c.latency_ms),
                      key=lambda c: c.latency_ms, default=None)
        if cache is not None and remembrable(result) and (result.winner != "eager" or fastest is not None):
            # An eager win is remembered too (with the fastest target, built only where a file is asked for):
            # the next optimize of this model and inputs returns the model at once instead of racing again.
            cache.put(key, {"winner": result.winner, "eager_ms": result.eager_ms, "load": result.load,
                            "latency_ms": {c.target: c.latency_ms for c in result.contenders
                                           if c.latency_ms and c.target != "eager"},
                            "fastest": fastest.target if fastest is not None else None,
                            "when": time.strftime("%Y-%m-%d %H:%M")})
            cache.save()
        if result.winner == "eager":
            _warn_eager(model, result.why)
            if fastest is None:
                return _chosen(EagerModule(model), result)
            return _chosen(EagerModule(model, built[fastest.target], fastest.target), result)
        return _chosen(built[result.winner], result)

    @staticmethod
    def _served(model: nn.Module, args: tuple, kwargs: dict, racing: list, shared: dict[str, Any]) -> Any:
        """The new sizes eager serves (in ``shared["served"]`` for the entrants' exports), where an entrant
        runs a file of fixed sizes."""
        if "served" not in shared and any(e.fixed_sizes and not e.refusal for e in racing):
            with step("finding the input sizes eager serves"):
                shared["served"] = new_sizes(model, args, kwargs)
        return shared.get("served")


def _precision_options(target: Target, precision: str, tolerance: Tolerance | None) -> dict[str, Any]:
    """What a raced target gets of ``precision`` (:meth:`~fxforge.targets.base.Target.precision_for`: the native
    target every precision, ONNX Runtime int8 for ``"int8"`` and ``"auto"``, Inductor int8 for both).

    Example:
        >>> from fxforge.targets import TARGETS
        >>> _precision_options(TARGETS["onnxruntime"], "auto", Tolerance())["precision"]
        'int8'
        >>> _precision_options(TARGETS["inductor"], "int8", None)
        {}
    """
    given = target.precision_for(precision) if tolerance is not None else None
    return {} if given is None else {"precision": given, "tolerance": tolerance}


class EagerModule(nn.Module):
    """The model itself, as ``target="auto"`` returns it when no target beat eager in its race: calls run the
    model (its hooks, live weights, every size); it shares the model's parameters, buffers and submodules
    under their own names (``state_dict`` keys are the model's). ``fastest`` is the fastest target's module
    (what :meth:`AutoTarget.write` writes and :meth:`AutoTarget.graph` shows); ``report`` is a copy of its
    report (``method="eager"`` without one) whose notes say that the model runs as it is.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> eager = EagerModule(lin)
        >>> torch.equal(eager(torch.ones(1, 2)), lin(torch.ones(1, 2))), list(eager.state_dict()) == ["weight", "bias"]
        (True, True)
        >>> _ = lin.eval(); eager.training   # the model's own flag
        False
    """

    training = FollowsTraining(lambda self: self.__dict__.get("original"))

    def __init__(self, model: nn.Module, fastest: nn.Module | None = None, target: str = "", *,
                 build_fastest: Callable[[], nn.Module] | None = None):
        super().__init__()
        self.__dict__["_build_fastest"] = build_fastest
        for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            self.__dict__[name] = getattr(model, name)
        self.__dict__["original"] = model
        self.__dict__["fastest"] = fastest
        self.__dict__["fastest_target"] = target
        # the fastest target's report (what it captured and rewrote), saying that the model runs as it is
        report = getattr(fastest, "report", None)
        self.report = report.copy() if isinstance(report, Report) else Report(method="eager")
        self.report.notes.append("target='auto' runs the model as it is: no target beat eager"
                                 + (f" (this report is the fastest target's, {target})" if target else ""))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.original(*args, **kwargs)

    def built_fastest(self) -> nn.Module | None:
        """The fastest target's module, built now where the race that chose eager was remembered (None where
        no target was built or can be)."""
        if self.fastest is None and self._build_fastest is not None:
            self.__dict__["fastest"] = self._build_fastest()
        return self.fastest

    def train(self, mode: bool = True) -> EagerModule:
        self.original.train(mode)  # (this module's flag is the model's)
        return self


def _warn_eager(model: nn.Module, why: str) -> None:
    """The :class:`RaceWarning` that auto returns the model as it is, and why (a race's, or a remembered one's),
    pointing at the user's ``fxforge.optimize`` call."""
    warnings.warn(f"fxforge: target='auto' returns {type(model).__name__} as it is: {why}", RaceWarning,
                  stacklevel=5)


def _remembered_eager(model: nn.Module, fastest: Any, stored: dict) -> EagerModule:
    """The model as it is, where a remembered race found no target faster than eager: nothing is built or timed
    (the fastest target is built only if its file or graph is asked for); the report says when it was
    raced and how to race again."""
    latencies = stored.get("latency_ms", {})
    ratio = stored["eager_ms"] / latencies[fastest.target] if latencies.get(fastest.target) else None
    result = Race("eager", f"remembered from the race of {stored.get('when', 'an earlier run')}: no target beat "
                           f"eager (the fastest, {fastest.target}, ran at "
                           f"{f'{ratio:.2f}x' if ratio else 'an unknown speed against'} eager)",
                  [Contender("eager", latency_ms=stored["eager_ms"], vs_eager=1.0),
                   *(Contender(t, latency_ms=ms, vs_eager=stored["eager_ms"] / ms) for t, ms in latencies.items())],
                  eager_ms=stored["eager_ms"], remembered=True, load=stored.get("load"),
                  notes=[("nothing was built or timed: the latencies are those remembered (FXFORGE_TARGET_CACHE=0 "
                          "races every time)")])
    module = EagerModule(model, None, fastest.target, build_fastest=fastest.build)
    return _chosen(module, result)


def _remembered(result: Race, stored: dict, then: float, now: float) -> Race:
    """A re-timed remembered winner's race: its new figures, the others' remembered latencies."""
    result.remembered = True
    winner = result.winner
    for target, ms in stored["latency_ms"].items():
        if target != winner:
            result.contenders.append(Contender(target, latency_ms=ms))
    result.why = (f"remembered from the race of {stored.get('when', 'an earlier run')} ({then:.2f}x eager then, "
                  f"{now:.2f}x now)")
    result.notes.append("only the winner was built; the other targets' latencies are those remembered "
                        "(FXFORGE_TARGET_CACHE=0 races every time)")
    return result


def _chosen(module: nn.Module, result: Race) -> nn.Module:
    """The winner, its report (and ``module.race``) holding the race."""
    module.race = result
    report = getattr(module, "report", None)
    if report is not None:
        report.race = result
    return module
