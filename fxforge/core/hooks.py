"""Hooks that stay quiet while fxforge runs the model for itself.

Building a plan runs the model several times (capture's check, verification, dynamo's run that finds where one
graph cannot hold it); the user's hooks must fire once per call the user makes, not once per run of fxforge's.

Example:
    >>> relu, seen = torch.nn.ReLU(), []
    >>> _ = relu.register_forward_hook(lambda m, args, out: seen.append(1))
    >>> with silenced_hooks([relu]):
    ...     _ = relu(torch.ones(1))
    >>> seen
    []
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

# The hook tables whose values are the hooks themselves (the others hold flags per hook).
_CALLABLE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@contextlib.contextmanager
def silenced_hooks(modules: list[nn.Module]) -> Iterator[None]:
    """Inside, the modules' hooks do nothing when called from this thread (they run as usual from others).

    A hook that collects features, or one that changes an output, must fire once per call the user makes, not
    once per run of fxforge's. The plan keeps each hooked module a module call, so its hooks fire when it runs.

    Example:
        >>> relu, seen = torch.nn.ReLU(), []
        >>> _ = relu.register_forward_hook(lambda m, args, out: seen.append(1))
        >>> with silenced_hooks([relu]):
        ...     _ = relu(torch.ones(1))
        >>> _ = relu(torch.ones(1)); seen
        [1]
    """
    me = threading.get_ident()

    def quiet(hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def hook_unless_building(*args: Any, **kwargs: Any) -> Any:
            return None if threading.get_ident() == me else hook(*args, **kwargs)
        return hook_unless_building

    replaced = []
    for module in modules:
        for name in _CALLABLE_HOOK_DICTS:
            table = getattr(module, name, None)
            for key, hook in list((table or {}).items()):
                table[key] = quiet(hook)
                replaced.append((table, key, hook))
    try:
        yield
    finally:
        for table, key, hook in replaced:
            if key in table:  # (a hook removed meanwhile stays removed)
                table[key] = hook
