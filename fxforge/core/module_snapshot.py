"""What tracing may write on a model, taken before and put back after: fxforge leaves no trace in the user's model.

A trace runs the model's forward on stand-ins (torch.fx's proxies, torch.export's fake tensors), and whatever the
forward writes on its modules meanwhile is made of them: a cache entry keyed and valued by a proxy (LeViT's
``attention_bias_cache``), a tensor constant torch.fx stows on the root (``_tensor_constant0``) when the trace
then fails, a buffer registered lazily. None of it may stay on the model: a later capture would find a proxy
of a finished trace, and fxforge's state watch would blame the model's forward for fxforge's own writes.

:class:`ModuleSnapshot` takes, for each module, its attributes, its parameter, buffer and submodule tables, and the
contents of its attributes that are plain containers (dicts, lists, sets: caches), and puts them back in place
(no ``__setattr__``: the model's watches see nothing).

Example:
    >>> class Cached(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.cache = {}
    >>> model = Cached()
    >>> with left_as_found(model):
    ...     model.cache["key"] = "a proxy"; model.extra = 1; model.register_buffer("b", torch.ones(1))
    >>> model.cache, hasattr(model, "extra"), list(model.buffers())
    ({}, False, [])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from fxforge.core.vocabulary import HOOK_DICTS

_TABLES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
_CONTAINERS = (dict, list, set)
_SKIPPED = frozenset(_TABLES) | frozenset(HOOK_DICTS)
_MISSING = object()


def _contents(value: Any) -> Any:
    """A shallow copy of a container's contents (a dict's items, a list's or a set's elements)."""
    return list(value.items()) if isinstance(value, dict) else list(value)


def _same_contents(value: Any, saved: list) -> bool:
    now = _contents(value)
    if len(now) != len(saved):
        return False
    if isinstance(value, set):
        return {id(v) for v in now} == {id(v) for v in saved}
    if isinstance(value, dict):
        return all((k1 is k2 or (type(k1) is type(k2) and isinstance(k1, (str, int)) and k1 == k2)) and v1 is v2
                   for (k1, v1), (k2, v2) in zip(now, saved))
    return all(a is b for a, b in zip(now, saved))


def _put_back(value: Any, saved: list) -> None:
    if isinstance(value, dict):
        value.clear()
        value.update(saved)
    elif isinstance(value, list):
        value[:] = saved
    else:
        value.clear()
        value.update(saved)


class ModuleSnapshot:
    """The Python state of some modules (see the module docstring), to see what changed and put it back.

    Args:
        modules: the modules (a model's ``modules()``).

    Example:
        >>> linear = torch.nn.Linear(2, 2); snapshot = ModuleSnapshot(list(linear.modules()))
        >>> linear.cache = {}; snapshot.changed()
        ['Linear.cache']
        >>> snapshot.restore(); snapshot.changed()
        []
    """

    def __init__(self, modules: list[nn.Module]):
        self._saved = []
        for module in modules:
            state = module.__dict__
            tables = {name: (state[name], _contents(state[name])) for name in _TABLES if name in state}
            containers = {name: (value, _contents(value)) for name, value in state.items()
                          if name not in _SKIPPED and type(value) in _CONTAINERS}
            self._saved.append((module, dict(state), tables, containers))

    def changed(self) -> list[str]:
        """``Class.name`` for each attribute set, added or removed, each table entry and each container's
        contents changed since the snapshot."""
        found = []
        for module, attributes, tables, containers in self._saved:
            state = module.__dict__
            names = [k for k in state.keys() | attributes.keys() if state.get(k, _MISSING) is not attributes.get(k)]
            names += [k for k, (value, saved) in {**tables, **containers}.items()
                      if state.get(k) is value and not _same_contents(value, saved)]
            found += [f"{type(module).__name__}.{name}" for name in sorted(set(names))]
        return found

    def restore(self) -> None:
        """Put every attribute, table entry and container's contents back as they were, in place."""
        for module, attributes, tables, containers in self._saved:
            state = module.__dict__
            for name in [k for k in state if k not in attributes]:
                del state[name]
            for name, value in attributes.items():
                if state.get(name, _MISSING) is not value:
                    state[name] = value
            for value, saved in [*tables.values(), *containers.values()]:
                if not _same_contents(value, saved):
                    _put_back(value, saved)


@contextlib.contextmanager
def left_as_found(root: nn.Module | Any) -> Iterator[ModuleSnapshot | None]:
    """Inside, ``root`` (a module, or anything else: then nothing is taken) may be written to by a trace; on the
    way out, however the block ends, every module it holds is put back as it was (see :class:`ModuleSnapshot`).

    Example:
        >>> relu = torch.nn.ReLU()
        >>> with left_as_found(relu):
        ...     relu._tensor_constant0 = torch.ones(1)
        >>> hasattr(relu, "_tensor_constant0")
        False
    """
    if not isinstance(root, nn.Module):
        yield None
        return
    snapshot = ModuleSnapshot(list(root.modules()))
    try:
        yield snapshot
    finally:
        snapshot.restore()

