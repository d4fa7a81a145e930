"""What a plan assumed about the model, checked on every call.

A plan is built for one input signature from the model as it was then. Everything it assumed is watched:

- **modes**: every module's ``training`` flag is part of the plan's key (:meth:`ModelWatch.modes`), so
  ``dropout.train()`` inside an eval model, or ``bn.train()`` alone, gets a plan of its own;
- **state**: anything else set on a module the model holds (a Python value its forward reads, like a
  temperature or ``bn.eps``; a submodule swapped; a parameter or buffer reassigned, as
  ``load_state_dict(..., assign=True)`` does), a parameter, buffer or submodule registered, a hook
  added or removed, and a parameter or buffer converted by ``.to()``/``.float()``/``.cuda()`` (which put new
  buffers straight into the modules' tables): every plan is dropped and built again on the next call
  (:meth:`ModelWatch.epoch`). Module classes are watched as torch's own compiler watches them: their
  ``__setattr__`` is wrapped once per class, and looks the instance up in a weak table; ``nn.Module._apply``
  (what every conversion runs) is wrapped once per process;
- **constants read**: a buffer (or tensor attribute) a rewrite read as a constant (a causal mask the attention
  rewrite proved causal and dropped; see :func:`fxforge.core.derived.read_as_constants`), watched as derived
  values' sources are (below): a change rebuilds every plan;
- **derived values** (folded and prepacked weights) are recomputed from their sources when a source
  changes: its version (an in-place change), its storage (``p.data = ...``, ``vector_to_parameters``), or an
  access to its ``.data`` (``p.data.mul_(2)``, ``bn.running_mean.data.add_(1)`` and ``.data``-style EMA updates
  change a tensor without telling its version counter; ``nn.Parameter.data`` and ``torch.Tensor.data`` are
  wrapped to see them) followed by a change of its contents (see :mod:`fxforge.core.derived`).

Not seen: writes straight into a module's ``_parameters``/``_buffers``/``_modules`` dicts (other than a
conversion's), and parameters swapped by ``torch.utils.swap_tensors`` outside a conversion (``docs/guards.md``
lists these, with ``opt.cache.clear()`` as the remedy).

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout()).eval()
    >>> watch = ModelWatch(model)
    >>> before = watch.epoch, watch.modes()
    >>> _ = model[1].train(); watch.modes() == before[1]
    False
    >>> model[0].extra = 3.0; watch.epoch > before[0]
    True
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from fxforge.core.derived import CONSTANT_READS, SourceStates
from fxforge.core.statistics import note_statistics
from fxforge.core.vocabulary import HOOK_DICTS

# module -> the watches that hold it (weak both ways: a watch dies with its plan cache, a module with its model)
_WATCHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WATCHERS_LOCK = threading.Lock()
_PATCHED_CLASSES: set[type] = set()


_MISSING = object()


def _value(module: nn.Module, name: str) -> Any:
    """What ``module.name`` holds: a parameter, buffer or submodule, else the instance attribute."""
    state = module.__dict__
    for table in ("_parameters", "_buffers", "_modules"):
        values = state.get(table)
        if values is not None and name in values:
            return values[name]
    return state.get(name, _MISSING)


def _same(old: Any, new: Any) -> bool:
    """Whether setting ``new`` over ``old`` changes nothing: the same object, or an equal plain value
    (tensors and modules count by identity)."""
    if old is new:
        return True
    if type(old) is not type(new) or isinstance(old, (torch.Tensor, nn.Module)):
        return False
    try:
        return bool(old == new)
    except Exception:  # noqa: BLE001 - values without a plain equality count as changed
        return False


def _notify(module: nn.Module, name: str, how: str = "was set") -> None:
    watches = _WATCHERS.get(module)
    if watches:
        for watch in list(watches):
            watch.changed(module, name, how)


def _watch_class(cls: type) -> None:
    """Wrap ``cls.__setattr__`` once so that setting an attribute on a watched instance is seen."""
    if cls in _PATCHED_CLASSES:
        return
    _PATCHED_CLASSES.add(cls)
    original = cls.__setattr__

    @functools.wraps(original)
    def watched_setattr(self: Any, name: str, value: Any) -> None:
        if self not in _WATCHERS:
            original(self, name, value)
            return
        old = _value(self, name)
        original(self, name, value)
        if not _same(old, _value(self, name)):  # setting what is already there changes nothing
            _notify(self, name)

    cls.__setattr__ = watched_setattr


def _registration_hook(module: nn.Module, name: str, value: Any) -> None:
    if module in _WATCHERS:
        _notify(module, name)


def _pointer(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.data_ptr()
    except RuntimeError:  # a tensor without storage (a subclass wrapping others)
        return None


def _tensor_states(module: nn.Module) -> dict[str, tuple]:
    """Each parameter and buffer of ``module`` itself: the object, its dtype, device and storage."""
    return {name: (t, t.dtype, t.device, _pointer(t)) for table in (module._parameters, module._buffers)
            for name, t in table.items() if t is not None}


@functools.cache
def _watch_conversions() -> None:
    """Wrap ``nn.Module._apply`` once per process (every ``.to()``, ``.float()``, ``.cuda()``... runs it on each
    module): a conversion of a watched module's parameters or buffers (a new object, dtype, device or storage)
    is a change of its state. Buffers are replaced straight in the module's ``_buffers``, which no
    ``__setattr__`` sees, and the plans hold the old ones (their folded weights computed from them)."""
    original = nn.Module._apply

    @functools.wraps(original)
    def watched_apply(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self not in _WATCHERS:
            return original(self, *args, **kwargs)
        before = _tensor_states(self)
        result = original(self, *args, **kwargs)
        after = _tensor_states(self)
        for name in [n for n in after.keys() | before.keys()
                     if before.get(n) is None or after.get(n) is None or before[n][0] is not after[n][0]
                     or before[n][1:] != after[n][1:]]:
            _notify(self, name, "was converted (.to(), .float(), ...)")
        return result

    nn.Module._apply = watched_apply


@functools.cache
def _install_registration_hooks() -> None:
    """torch's global hooks for ``register_parameter``/``register_buffer``/``register_module`` (which bypass
    ``__setattr__``); installed once per process."""
    torch_module.register_module_parameter_registration_hook(_registration_hook)
    torch_module.register_module_buffer_registration_hook(_registration_hook)
    torch_module.register_module_module_registration_hook(_registration_hook)


_HOOK_REMOVALS = [0]


@functools.cache
def _count_hook_removals() -> None:
    """Wrap ``RemovableHandle.remove`` once per process so that removing a hook is counted (making one is
    counted by torch itself: ``RemovableHandle.next_id``)."""
    original = RemovableHandle.remove

    @functools.wraps(original)
    def remove(self: RemovableHandle) -> None:
        _HOOK_REMOVALS[0] += 1
        original(self)

    RemovableHandle.remove = remove


def hook_generation() -> tuple[int, int]:
    """Moves whenever a hook handle is made or removed anywhere in the process (module hooks, and others:
    a change tells a watch to count its modules' hooks again, not that they changed).

    Example:
        >>> before = hook_generation()
        >>> handle = torch.nn.ReLU().register_forward_hook(lambda *a: None)
        >>> after_adding = hook_generation(); handle.remove()
        >>> before != after_adding != hook_generation()
        True
    """
    _count_hook_removals()
    return RemovableHandle.next_id, _HOOK_REMOVALS[0]


def global_hooks() -> int:
    """How many module hooks are registered for every module of the process
    (``torch.nn.modules.module.register_module_forward_hook`` and its kin): a plan cannot call them for the
    modules it does not call, so while there are any the model runs eagerly.

    Example:
        >>> global_hooks()
        0
    """
    return (len(torch_module._global_forward_hooks) + len(torch_module._global_forward_pre_hooks)
            + len(torch_module._global_backward_hooks) + len(torch_module._global_backward_pre_hooks))


class ModelWatch:
    """The watch over one model's modules: its modes, and an epoch that moves when its state changes.

    Args:
        model: the root module; every module it holds now is watched (a module registered later changes
            the epoch, and the next plan watches it).

    Example:
        >>> watch = ModelWatch(torch.nn.Linear(2, 2))
        >>> watch.epoch, watch.hook_count()
        (0, 0)
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._mode_numbers: dict[tuple[bool, ...], int] = {}
        self._epoch = 0
        self._constants: SourceStates | None = None
        self.reasons: list[str] = []
        self._modes_dirty = True
        self._modes: tuple[bool, ...] = ()
        self._modules: list[nn.Module] = []
        self._hook_dicts: list[dict] = []
        self.rewatch()

    @property
    def epoch(self) -> int:
        """A number that moves whenever the model's state changes (see the module docstring); reading it checks
        the tensors rewrites read as constants (a change moves it, once)."""
        if self._constants is not None and self._constants.changed():
            self._epoch += 1
            self.reasons.append(f"a tensor a rewrite read as a constant changed ({self._constants_named()})")
            del self.reasons[:-3]
        return self._epoch

    def constants_read(self) -> list[str]:
        """The model's tensors a rewrite read as constants, by qualified name: watched on every call.

        Example:
            >>> from fxforge.core.derived import read_as_constants
            >>> model = torch.nn.Module(); model.register_buffer("mask", torch.ones(2, dtype=torch.bool))
            >>> read_as_constants([model.mask]); watch = ModelWatch(model); watch.constants_read()
            ['mask']
            >>> _ = model.mask.data.fill_(False); watch.epoch, watch.reasons[-1]
            (1, 'a tensor a rewrite read as a constant changed (mask)')
        """
        return [name for name, _ in self._constant_names]

    def _constants_named(self) -> str:
        names = self.constants_read()
        return ", ".join(names[:3]) + (f" or {len(names) - 3} more" if len(names) > 3 else "")

    def _watch_constants(self) -> None:
        """Find the model's buffers and tensor attributes that a rewrite read as constants."""
        found = []
        for prefix, module in self.model.named_modules(remove_duplicate=False):
            for name, value in [*module._buffers.items(), *module.__dict__.items()]:
                if isinstance(value, torch.Tensor) and CONSTANT_READS.holds(value):
                    found.append((f"{prefix}.{name}" if prefix else name, value))
        self._constant_names = list({id(t): (n, t) for n, t in found}.values())
        self._constants = SourceStates([t for _, t in self._constant_names]) if found else None

    def rewatch(self) -> None:
        """Watch the model's modules as they are now (after a re-plan: new submodules, new hooks, constants read)."""
        _install_registration_hooks()
        _watch_conversions()
        note_statistics(self.model)  # (before a plan's derived values are watched by them)
        self._watch_constants()
        modules = list(self.model.modules())
        with _WATCHERS_LOCK:
            for module in modules:
                _watch_class(type(module))
                _WATCHERS.setdefault(module, weakref.WeakSet()).add(self)
        self._modules = modules
        # The root's own hooks run around the plan (torch's __call__ runs them), so they do not change it.
        self._hook_dicts = [getattr(m, name) for m in modules[1:] for name in HOOK_DICTS if hasattr(m, name)]
        self._hook_generation = hook_generation()
        self._hooks = self.hook_count()
        self._modes_dirty = True

    def watched(self) -> list[nn.Module]:
        """The modules watched (the model's modules when they were last watched)."""
        return list(self._modules)

    def changed(self, module: nn.Module, name: str, how: str = "was set") -> None:
        """A watched module's attribute ``name`` was set (or a parameter, buffer or submodule registered, or
        converted: ``how`` says which)."""
        if name == "training":
            self._modes_dirty = True
            return
        self._epoch += 1
        self.reasons.append(f"{type(module).__name__}.{name} {how}")
        del self.reasons[:-3]

    def hooks_changed(self) -> bool:
        """Whether hooks were added or removed since the modules were last watched. Counted again only when
        a hook handle was made or removed anywhere in the process since the last count (a few hundred
        dictionaries on a large model: not on every call)."""
        generation = hook_generation()
        if generation == self._hook_generation:
            return False
        if self.hook_count() != self._hooks:
            return True
        self._hook_generation = generation
        return False

    def hook_count(self) -> int:
        """The number of forward and backward hooks on the watched modules below the root (a change means
        hooks were added or removed)."""
        return sum(map(len, self._hook_dicts))

    def modes(self) -> int:
        """Every watched module's ``training`` flag, recomputed only after one was set, as a small number:
        one per distinct combination seen (a plan key holds it; hashing hundreds of flags on every call
        would cost more than the rest of the key)."""
        if self._modes_dirty:
            flags = tuple(m.training for m in self._modules)
            self._modes = self._mode_numbers.setdefault(flags, len(self._mode_numbers))
            self._updates_state = any(m.training and m._buffers for m in self._modules)
            self._modes_dirty = False
        return self._modes

    def updates_state(self) -> bool:
        """Whether a call now may update buffers behind their version counters: a module in training mode
        owns buffers (BatchNorm's running statistics).

        Example:
            >>> ModelWatch(torch.nn.BatchNorm1d(2).train()).updates_state()
            True
        """
        self.modes()
        return self._updates_state


class ModuleState:
    """The Python state of some modules (their attributes, parameters, buffers and submodules, by identity),
    to see what a block set on them and put it back.

    A plan's build runs the model's forward several times (tracing, checking, verifying). A forward that sets
    the module's state (a call counter, a cache it fills) would do so each time, and the graph does not do it
    at all: :class:`~fxforge.runtime.plans.PlanCache` puts the state back and runs such a model eagerly.

    Example:
        >>> linear = torch.nn.Linear(2, 2)
        >>> state = ModuleState([linear])
        >>> linear.calls = 1; linear.weight = torch.nn.Parameter(torch.zeros(2, 2))
        >>> state.changes()
        ['Linear.calls', 'Linear.weight']
        >>> state.restore(); hasattr(linear, "calls"), float(linear.weight.abs().sum()) > 0
        (False, True)
    """

    _TABLES = ("_parameters", "_buffers", "_modules")

    def __init__(self, modules: list[nn.Module]):
        self._saved = [(m, dict(m.__dict__), *(dict(getattr(m, t)) for t in self._TABLES)) for m in modules]

    @staticmethod
    def _differ(now: dict, saved: dict) -> list[str]:
        names = [k for k, v in saved.items() if not _same(v, now.get(k, _MISSING))]
        return names + [k for k in now if k not in saved]

    def changes(self) -> list[str]:
        """``Class.attribute`` for each value set, added or removed since the state was taken."""
        found = []
        for module, attributes, *tables in self._saved:
            names = [k for k in self._differ(module.__dict__, attributes) if k not in self._TABLES]
            for table, saved in zip(self._TABLES, tables):
                names += self._differ(getattr(module, table), saved)
            found += [f"{type(module).__name__}.{name}" for name in dict.fromkeys(names)]
        return found

    def restore(self) -> None:
        """Put every value back (the tables in place: an optimized module shares them), without notifying
        watches."""
        for module, attributes, *tables in self._saved:
            for table, saved in zip(self._TABLES, tables):
                values = getattr(module, table)
                values.clear()
                values.update(saved)
            state = module.__dict__
            for name in [k for k in state if k not in attributes]:
                del state[name]
            for name, value in attributes.items():
                if name not in self._TABLES and state.get(name, _MISSING) is not value:
                    state[name] = value


def needs_grad(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a call of ``module`` records gradients (grad mode on, and a parameter or an input requires
    them): its plan must keep every op eager has.

    Example:
        >>> with torch.no_grad():
        ...     needs_grad(torch.nn.Linear(1, 1), (torch.ones(1),), {})
        False
    """
    if not torch.is_grad_enabled():
        return False
    if any(p.requires_grad for p in module.parameters()):
        return True
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in torch.utils._pytree.tree_leaves((args, kwargs)))
