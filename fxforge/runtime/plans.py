"""One plan per kind of call, built on first sight, checked on every call, eager when it cannot be built.

A :class:`PlanCache` is the per-call half of an optimized module. For each call it:

1. runs the model eagerly while module hooks registered for every module of the process exist (a plan
   does not call the modules it replaced), or inside the cache's own build (capture runs the model);
2. drops every plan when the model's state changed since they were built (a Python value or a submodule
   set, a parameter or buffer reassigned or registered, a hook added or removed: see
   :mod:`fxforge.runtime.guards`), and builds again;
3. finds the plan for the call's key: its input signature
   (:func:`~fxforge.runtime.signature.input_signature`), every module's ``training`` flag, and its
   :class:`~fxforge.core.plan.CallConditions` (gradients recorded, autocast); builds it if there is none;
4. recomputes the plan's derived values (folded and prepacked weights) if one of their sources changed, or
   after a training-mode call (BatchNorm updates its statistics without telling their version counters);
5. runs the plan's executable.

Building a plan is :mod:`fxforge.lowering.build`'s job (the target hands its build function in). How plans treat
sizes is :mod:`fxforge.runtime.plan_policy`, the checks at new sizes :mod:`fxforge.runtime.first_use`.

Example:
    >>> import torch
    >>> from fxforge.lowering.build import plan_builder
    >>> relu = torch.nn.ReLU()
    >>> cache = PlanCache(relu, plan_builder(relu))
    >>> cache((torch.ones(2),), {}).tolist()
    [1.0, 1.0]
    >>> len(cache.plans)
    1
"""

from __future__ import annotations

import collections
import threading
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.core.captured import Captured
from fxforge.core.hooks import silenced_hooks
from fxforge.core.plan import CallConditions, Plan
from fxforge.core.verify import Comparison
from fxforge.runtime import fallbacks
from fxforge.runtime.fallbacks import FallbackWarning, GradientsWarning, caller_stacklevel, gradients_cause
from fxforge.runtime.first_use import against_eager, at, fx_plan_of_family, sizes
from fxforge.runtime.guards import ModelWatch, ModuleState, global_hooks, needs_grad
from fxforge.runtime.plan_policy import (  # noqa: F401 - as before
    MAX_PLANS,
    MAX_REBUILDS,
    MAX_SERVED,
    ShapePolicy,
    dims_for,
    kept_dims,
    numel,
    smaller_example,
)
from fxforge.runtime.signature import describe_signature, differing_dims, family_of, input_signature, sizes_of

# (args, kwargs, conditions, dynamic) -> the plan for calls like this one (dynamic: None for the input signature
# only, else the input dims to keep symbolic or a torch.export dynamic_shapes spec); raises when the module
# cannot be captured.
PlanBuilder = Callable[..., Plan]

_MISSING = object()


def _copy_input(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of an input that capture may run the model on (outside inference mode, as the caller's
    tensor requires gradients or not)."""
    return tensor.detach().clone().requires_grad_(tensor.requires_grad)


class PlanCache:
    """Plans for ``module`` per kind of call, built by ``build`` on first sight and checked on every call.

    Thread-safe: concurrent first calls build one plan (the others wait for it); a call from inside the
    build (a decorated class's forward, run by capture) runs eagerly.

    Args:
        module: the model.
        build: ``(args, kwargs, conditions, dynamic=None) -> Plan`` (see :func:`fxforge.lowering.build.plan_builder`).
        eager: what runs when no plan can be built (default: the module).
        policy: how plans treat input sizes (a :class:`ShapePolicy`).

    Example:
        >>> from fxforge.lowering.build import plan_builder
        >>> linear = torch.nn.Linear(2, 2)
        >>> cache = PlanCache(linear, plan_builder(linear))
        >>> with torch.no_grad():
        ...     _ = cache((torch.ones(1, 2),), {})
        >>> cache.last.captured.method
        'fx'
    """

    def __init__(self, module: nn.Module, build: PlanBuilder, eager: Callable[..., Any] | None = None,
                 policy: ShapePolicy | None = None):
        self.module = module
        self.build = build
        self.eager = eager if eager is not None else module
        # error -> whether something else takes over the calls a capture failure leaves (dynamo, graph by graph)
        self.divert: Callable[[BaseException], bool] | None = None
        self.policy = policy or ShapePolicy()
        self.plans: dict[Hashable, Plan | None] = {}
        self.plans_built = 0  # builds made (captures), for reports and benchmarks
        self._served: collections.OrderedDict[Hashable, Plan] = collections.OrderedDict()
        self._families: dict[Hashable, list[Hashable]] = {}  # family -> signatures built for, in order
        self._dynamic_dims: dict[Hashable, set] = {}  # family -> input dims made dynamic so far
        self._static_only: set[Hashable] = set()  # families torch.export could not make dynamic
        self._specialized: dict[Hashable, set] = {}  # family -> input dims torch.export kept static when asked
        # family -> (signature, args, kwargs): copies of the smallest inputs a plan of the family was built on, which
        # a later shape-generic plan of the family is built on (capture, checks and autotune run at those sizes)
        self._examples: dict[Hashable, tuple[Hashable, tuple, dict]] = {}
        self.last: Plan | None = None
        self.notes: list[str] = []
        self._watch = ModelWatch(module)
        self._epoch = self._watch.epoch
        self._rebuilds = 0
        self._training_calls = 0  # how many calls ran in training mode: BatchNorm statistics moved
        self._refreshed: dict[int, int] = {}  # id(plan) -> training calls when its derived values were computed
        self._generic: dict[Hashable, list[Plan]] = {}  # family -> its shape-generic plans, newest first
        self._warned: set[str] = set()
        self.fallbacks: list[str] = []  # every FallbackWarning's message, in order: why calls ran eagerly
        self._warned_gradients = False
        self._set_during_build: list[str] = []
        self._state_setting_builds = 0
        self._eager_reason: str | None = None
        self._lock = threading.RLock()
        self._building = threading.local()
        self._first = threading.local()  # pending: (plan, untraced, reuse key) when this call needs _first_use
        self._checked_at: dict[int, set[frozenset]] = {}  # id(plan) -> untraced values checked against eager
        self._unchecked: dict[Hashable, frozenset] = {}  # key -> untraced values of a plan built on a stand-in size
        self._no_reuse: set[Hashable] = set()  # keys a torch.fx plan of other sizes differed from eager at
        self.plans_reused = 0  # new input signatures served by a torch.fx plan of other sizes, after a check

    @property
    def capturing(self) -> bool:
        """Whether this thread is inside this cache's build (a call made there must run eagerly)."""
        return getattr(self._building, "active", False)

    def plan_for(self, args: tuple, kwargs: dict, conditions: CallConditions | None = None) -> Plan | None:
        """The plan for a call like this one (by default: no gradients, autocast as it is now), built now if
        there is none yet.

        A call whose input signature has no plan of its own is first offered to the shape-generic plans of
        its family (calls that differ only in sizes): the first one whose shape guard accepts it serves it,
        and serves that signature from then on without asking again.

        Returns None, after one warning per distinct reason, when the module cannot be captured (or its
        state keeps changing, or it holds ``max_plans`` plans already).
        """
        conditions = conditions or CallConditions.now()
        with self._lock:
            if not self._still_valid():
                return None
            signature = input_signature(args, kwargs, self.module.training)
            key = (signature, self._watch.modes(), conditions)
            plan = self.plans.get(key, _MISSING)
            if key in self._unchecked:  # a shape-generic plan built for a call at a size it was not traced at
                self._first.pending = (plan, self._unchecked[key], None)
            if plan is _MISSING:
                plan = self._served.get(key)
                if plan is not None:
                    self._served.move_to_end(key)
                else:
                    plan = self._shape_generic_plan(key, signature) or self._reusable(key, signature)
                if plan is None:
                    plan = self._new_plan(key, signature, args, kwargs, conditions)
                    if plan is _MISSING:
                        return None  # this call runs eagerly (and sets the state itself, once, as eager does)
            if plan is not None:
                self.last = plan
                if self._refreshed.setdefault(id(plan), self._training_calls) != self._training_calls:
                    plan.derived.refresh()
                    self._refreshed[id(plan)] = self._training_calls
            return plan

    def _shape_generic_plan(self, key: Hashable, signature: Hashable) -> Plan | None:
        """A shape-generic plan of the call's family that serves it (remembered for its signature), or None.

        A call that binds a symbol to 0 or 1 (a batch of one) is at a size torch.export never traced: the first
        such call of a plan (per symbols at those values) is checked against eager first (:meth:`_first_use`)."""
        family = (family_of(signature), *key[1:])
        sizes = sizes_of(signature)
        for plan in self._generic.get(family, ()):
            if plan.shapes.check_sizes(sizes) is None:
                untraced = plan.shapes.untraced(sizes)
                if untraced and untraced not in self._checked_at.get(id(plan), ()):
                    self._first.pending = (plan, untraced, None)
                    return plan
                self._serve(key, plan)
                return plan
        return None

    def _serve(self, key: Hashable, plan: Plan) -> None:
        self._served[key] = plan
        if len(self._served) > MAX_SERVED:
            self._served.popitem(last=False)

    def _reusable(self, key: Hashable, signature: Hashable) -> Plan | None:
        """A torch.fx plan of the call's family built for other sizes, to try on this call after a check
        (:func:`~fxforge.runtime.first_use.fx_plan_of_family`); only while a call runs, not with ``dynamic=False``."""
        if not getattr(self._first, "calling", False) or key in self._no_reuse or self.policy.dynamic is False:
            return None
        plan = fx_plan_of_family(self.plans, key)
        if plan is not None:
            self._first.pending = (plan, frozenset(), key)
        return plan

    def _first_use(self, plan: Plan, untraced: frozenset, args: tuple, kwargs: dict, reuse: Hashable = None) -> Any:
        """Run a call at sizes ``plan`` was never traced at (``untraced``: symbols bound to 0 or 1; ``reuse``: the
        key of a call of new sizes that a torch.fx plan built for others may serve, see :meth:`_reusable`): the
        plan and eager, both isolated (same random numbers, state put back), compared (for ``reuse`` on random
        inputs of the same sizes too); the plan serves those values from then on if they agree, and never
        again if not (a model whose code branches on a batch of one: a plan of their own is built on the next
        such call). The call itself then runs as usual."""
        result = against_eager(plan.executable, self.eager, self.module, self._watch.watched(), (args, kwargs),
                               random=reuse is not None)
        with self._lock:
            if reuse is not None:
                self._reused_check(plan, reuse, result)
            elif result.ok:
                self._checked_at.setdefault(id(plan), set()).add(untraced)
                for k in [k for k, v in self._unchecked.items() if v == untraced and self.plans.get(k) is plan]:
                    del self._unchecked[k]
                self.notes.append(f"checked against eager at {at(untraced)} (a size torch.export does not trace): served")
            else:
                plan.shapes.exclude(untraced)
                self._served = collections.OrderedDict((k, p) for k, p in self._served.items() if p is not plan
                                                       or plan.shapes.check_sizes(sizes_of(k[0])) is None)
                for k in [k for k, v in self._unchecked.items() if v == untraced and self.plans.get(k) is plan]:
                    del self._unchecked[k], self.plans[k]  # (the plan stays held by its family)
                self.notes.append(f"the shape-generic plan differs from eager at {at(untraced)} ({result.reason}): "
                                  "those sizes get a plan of their own")
        if result.ok:
            return plan.executable(*args, **kwargs)
        return self.eager(*args, **kwargs)

    def _reused_check(self, plan: Plan, key: Hashable, result: Comparison) -> None:
        """Serve ``key`` by ``plan`` from now on if the check agreed, else plan it on its next call (16 notes at most)."""
        built = f"the torch.fx plan built for {describe_signature(plan.captured.example_args, plan.captured.example_kwargs)}"
        if result.ok:
            self.plans_reused += 1
            self._serve(key, plan)
        else:
            self._no_reuse.add(key)
        if self.plans_reused + len(self._no_reuse) <= 16:
            self.notes.append(f"served new sizes {sizes(key[0])} by {built}, checked against eager on the call's inputs "
                              "and random ones (no re-plan)" if result.ok else f"{built} differs from eager at "
                              f"{sizes(key[0])} ({result.reason}): those sizes get a plan of their own")

    def _new_plan(self, key: Hashable, signature: Hashable, args: tuple, kwargs: dict,
                  conditions: CallConditions) -> Any:
        """Build the plan for a call no plan serves: shape-generic where the policy says so (else for this
        signature, or torch.fx's), none past ``max_plans``; ``_MISSING``: the forward set the model's state."""
        family = (family_of(signature), *key[1:])
        held = len({id(p) for p in self.plans.values() if p is not None})
        if held >= self.policy.max_plans:
            self._warn(f"running {type(self.module).__name__} eagerly for inputs no plan serves (first: "
                       f"{describe_signature(args, kwargs)}): it holds {held} plans already (max_plans="
                       f"{self.policy.max_plans}). Pass dynamic_shapes= (or dynamic=True) so that one plan serves "
                       "many sizes, or a larger max_plans=", once="max_plans")
            self.plans[key] = None
            return None
        differed = [g for g in self._generic.get(family, ()) if g.shapes.excludes(sizes_of(signature))]
        dynamic = None if differed else self._dynamic_for(family, signature)  # (sizes a generic plan differed at)
        example = smaller_example(self._examples.get(family), signature, dynamic)
        if example is not None:
            plan = self._build(example[1], example[2], conditions, dynamic, quiet=True)
            if self._forward_set_state():
                return _MISSING
            if plan is not None and plan.shapes is not None and plan.shapes.check_sizes(sizes_of(signature)) is None:
                plan.report.notes.append(f"built on an earlier call's inputs {describe_signature(example[1], example[2])} (the "
                                         f"smallest of its kind seen), for the call {describe_signature(args, kwargs)}")
            else:  # the plan does not serve the call that needed it: build at the call's own sizes
                example = None
        if example is None:
            plan = self._build(args, kwargs, conditions, dynamic, quiet=dynamic is not None, family=family)
        if self._forward_set_state():
            return _MISSING
        lost = (dynamic - kept_dims(plan.shapes) if isinstance(dynamic, frozenset) and plan is not None and self.policy.dynamic
                is not True and isinstance(plan.executable, torch.fx.GraphModule) else set())  # (not compiled plans)
        if lost:  # torch.export specialised dims that change (an LSTM's length): a torch.fx plan serves them instead
            self._specialized.setdefault(family, set()).update(lost)
            fx = self._build(args, kwargs, conditions, "fx", quiet=True, family=family)
            if fx is not None and not self._set_during_build:
                plan, dynamic = fx, "fx"
        if dynamic is not None and dynamic != "fx":
            reason = ("torch.export could not capture it" if plan is None else "torch.export kept no dim dynamic"
                      if plan.shapes is None else plan.shapes.check_sizes(sizes_of(signature)))
            if reason is not None:
                self.notes.append(f"one plan per input signature for {describe_signature(args, kwargs)}: a "
                                  f"shape-generic plan could not be built ({reason})")
                if plan is None:
                    self._static_only.add(family)  # (no more tries: each costs a capture)
                plan = self._build(args, kwargs, conditions, None, family=family)
                if self._forward_set_state():
                    return _MISSING
        self.plans[key] = plan
        if plan is not None and plan.shapes is not None and plan.shapes.untraced(sizes_of(signature)):
            self._unchecked[key] = plan.shapes.untraced(sizes_of(signature))  # (built on a stand-in size)
            self._first.pending = (plan, self._unchecked[key], None)
        self._families.setdefault(family, []).append(signature)
        if plan is not None and plan.shapes is not None:
            self._adopt(family, plan, dynamic)
        self._say_what_gradients_cost(plan, conditions)
        return plan

    def _dynamic_for(self, family: Hashable, signature: Hashable) -> Any:
        """What a new plan for this signature keeps dynamic (:func:`~fxforge.runtime.plan_policy.dims_for`)."""
        if family in self._static_only:
            return None
        changed = set().union(*(differing_dims(signature, other) for other in self._families.get(family, [])))
        if changed & self._specialized.get(family, set()):
            return "fx"  # torch.export specialises a dim that changed: a torch.fx graph, tried at new sizes
        return dims_for(self.policy, signature, self._families.get(family, []), self._dynamic_dims.get(family, set()))

    def _remember_example(self, family: Hashable, args: tuple, kwargs: dict) -> None:
        """Keep copies of a build's inputs as ``family``'s example when they are its smallest so far."""
        signature = input_signature(args, kwargs, self.module.training)
        held = self._examples.get(family)
        if held is None or numel(sizes_of(signature)) < numel(sizes_of(held[0])):
            self._examples[family] = (signature, args, kwargs)

    def _adopt(self, family: Hashable, plan: Plan, dynamic: Any) -> None:
        """Make a new shape-generic plan the one its family's calls find, and retire the plans it makes
        redundant (those built for signatures it serves): their graphs and weights are freed."""
        self._generic.setdefault(family, []).insert(0, plan)
        if isinstance(dynamic, frozenset):
            self._dynamic_dims[family] = set(dynamic)
        for other in [k for k, p in self.plans.items() if p is not None and p is not plan]:
            if ((family_of(other[0]), *other[1:]) == family and plan.shapes.check_sizes(sizes_of(other[0])) is None
                    and not plan.shapes.untraced(sizes_of(other[0]))):  # (a plan at an untraced size stays)
                retired = self.plans.pop(other)
                self._refreshed.pop(id(retired), None)
                if retired in self._generic[family]:
                    self._generic[family].remove(retired)
                self._served[other] = plan
        held = {id(p) for p in self.plans.values()}
        for other, served in list(self._served.items()):
            if id(served) not in held:  # served by a plan just retired: the new one, or none
                if plan.shapes.check_sizes(sizes_of(other[0])) is None and not plan.shapes.untraced(sizes_of(other[0])):
                    self._served[other] = plan
                else:
                    del self._served[other]

    def _build(self, args: tuple, kwargs: dict, conditions: CallConditions, dynamic: Any = None, *,
               quiet: bool = False, family: Hashable | None = None) -> Plan | None:
        """Build a plan on copies of the inputs (capture and verification run the model several times: the
        caller's tensors must not see that), noting what the model's forward set on its modules meanwhile.
        A failure warns (unless ``quiet``: the caller tries again otherwise) and gives None. With ``family``,
        the copies of a successful build's inputs may become that family's example (see ``_examples``)."""
        state = ModuleState(self._watch.watched())
        plan, error = None, None
        self._building.active = True
        try:
            with torch.inference_mode(False):
                copies = pytree.tree_map_only(torch.Tensor, _copy_input, (args, kwargs))
            # Building draws random numbers (random inputs, models with dropout run during capture and checks):
            # the caller's generators are left as eager would leave them, so its dropout masks stay eager's.
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            self.plans_built += 1
            with silenced_hooks(self._watch.watched()), torch.random.fork_rng(devices=None if cuda else []):
                # (a builder that knows nothing of dynamic dims is called as before)
                plan = self.build(*copies, conditions, *(() if dynamic is None else (dynamic,)))
        except Exception as failure:  # noqa: BLE001 - a model's limit runs eagerly; fxforge's own is raised below
            error = failure
        finally:
            self._building.active = False
        if plan is not None and family is not None:
            self._remember_example(family, *copies)
        self._set_during_build = state.changes()
        if self._set_during_build:
            state.restore()  # (a graph of such a forward differs from it: its failure is no news)
        elif (isinstance(error, fallbacks.MODEL_LIMITS) and not quiet
              and not (self.divert is not None and self.divert(error))):
            reason = fallbacks.fallback_reason(error)
            self._warn(f"running {type(self.module).__name__} eagerly for inputs "
                       f"{describe_signature(args, kwargs)}: {reason}")
        self._watch.rewatch()  # what the build set (and put back) is not a change of the model
        self._epoch = self._watch.epoch
        if error is not None and not self._set_during_build and not isinstance(error, fallbacks.MODEL_LIMITS):
            raise error  # fxforge's own failure (a pass, verification, lowering): a bug to see, not a fallback
        return plan

    def _forward_set_state(self) -> bool:
        """Whether the last build saw the model's forward set its own state (put back since). The first time
        the call runs eagerly, since a model may fill a cache on its first call only; the second time the
        model runs eagerly from then on (a graph cannot do what such a forward does)."""
        if not self._set_during_build:
            return False
        self._state_setting_builds += 1
        names = ", ".join(self._set_during_build[:3])
        if self._state_setting_builds == 1:
            self.notes.append(f"forward set {names}: this call ran eagerly; the next one builds again")
        else:
            self._eager_reason = f"its forward sets {names} on every call, which a graph cannot repeat"
            self._warn(f"running {type(self.module).__name__} eagerly from now on: {self._eager_reason}")
        return True

    def _say_what_gradients_cost(self, plan: Plan | None, conditions: CallConditions) -> None:
        """Warn once when a plan for calls that record gradients had to leave rewrites out for them."""
        if plan is None or not conditions.gradients:
            return
        lost = [m for m in plan.report.near_misses if m.reason.endswith(CallConditions.FOR_GRADIENTS)]
        if lost and not self._warned_gradients:
            self._warned_gradients = True
            cause = gradients_cause(lost, plan.captured.graph_module)
            warnings.warn(f"fxforge: {type(self.module).__name__} was called with gradients recorded, so these "
                          f"rewrites did not apply (its parameters get eager's gradients): {cause}; call it under "
                          "torch.no_grad() or torch.inference_mode() for the inference plan", GradientsWarning,
                          stacklevel=caller_stacklevel())  # the user's line that called the module

    def _still_valid(self) -> bool:
        """Drop every plan if the model's state changed since they were built; False once it changed too
        often (the model then runs eagerly)."""
        if self._eager_reason is not None:
            return False
        watch = self._watch
        if watch.epoch == self._epoch and not watch.hooks_changed():
            return self._rebuilds <= MAX_REBUILDS
        if watch.epoch == self._epoch:
            reason = "hooks were added or removed"
        else:
            reason = watch.reasons[-1] if watch.reasons else "the model changed"
        self.clear()
        self._rebuilds += 1
        self.notes.append(f"plans built again: {reason}")
        if self._rebuilds > MAX_REBUILDS:
            self._warn(f"running {type(self.module).__name__} eagerly from now on: its state changed "
                       f"{self._rebuilds} times since it was optimized (last: {reason}), "
                       "and each change costs a new capture")
            return False
        return True

    def _warn(self, message: str, once: str | None = None) -> None:
        """Warn once per message (or once per ``once`` key)."""
        if (once or message) not in self._warned:
            self._warned.add(once or message)
            self.fallbacks.append(message)
            warnings.warn(f"fxforge: {message}", FallbackWarning, stacklevel=5)

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        self._first.pending, self._first.calling = None, True
        try:
            plan = self.checked_plan(args, kwargs)
        finally:
            self._first.calling = False
        if plan is None:
            return self.eager(*args, **kwargs)
        pending, self._first.pending = self._first.pending, None
        if pending is not None and pending[0] is plan:
            return self._first_use(plan, pending[1], args, kwargs, pending[2])
        return plan.executable(*args, **kwargs)

    def checked_plan(self, args: tuple, kwargs: dict) -> Plan | None:
        """Every guard a call passes before its plan runs (the per-call cost that
        ``benchmarks/guard_overhead.py`` measures): the model's state and hooks, the call's signature, modes,
        gradients and autocast, and derived weights brought up to date. None: this call runs eagerly.

        Example:
            >>> cache = PlanCache(torch.nn.ReLU(), lambda *a: None)
            >>> cache.checked_plan((torch.ones(1),), {}) is None   # a builder that gives no plan: eager
            True
        """
        if self.capturing:
            return None
        if global_hooks():
            self._warn(f"running {type(self.module).__name__} eagerly while module hooks registered for every "
                       "module exist (a plan does not call the modules it replaced)")
            return None
        plan = self.plan_for(args, kwargs, CallConditions.now(needs_grad(self.module, args, kwargs)))
        if plan is None:
            return None
        plan.derived.refresh_if_stale()
        if self._watch.updates_state():
            self._training_calls += 1
        return plan

    @property
    def captured(self) -> Captured | None:
        """The most recently used plan's rewritten graph."""
        return self.last.captured if self.last is not None else None

    def clear(self) -> None:
        """Forget every plan (after new weights are loaded, or the module changed)."""
        with self._lock:
            self.plans.clear()
            self._served.clear()
            self._generic.clear()
            self._refreshed.clear()
            self._checked_at.clear()
            self._unchecked.clear()
            self._no_reuse.clear()
            self.last = None
            self._watch.rewatch()
            self._epoch = self._watch.epoch
