"""One rewritten graph per input signature, captured on first sight, eager when capture fails.

Example:
    >>> import torch
    >>> cache = GraphCache(torch.nn.ReLU(), eager=torch.nn.ReLU())
    >>> cache((torch.ones(2),), {}).tolist()
    [1.0, 1.0]
    >>> len(cache.graphs)
    1
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from torch import nn

from fxforge.capture import capture
from fxforge.capture.source import first_line
from fxforge.captured import Captured
from fxforge.rewrites.pipeline import rewrite
from fxforge.runtime.lowering import lower
from fxforge.runtime.signature import describe_signature, input_signature


class FallbackWarning(UserWarning):
    """fxforge could not capture a model for some inputs and runs it eagerly instead."""


class GraphCache:
    """Captures and rewrites ``module`` per input signature and runs the right graph for each call.

    Args:
        module: what is captured (its mode at call time is the mode captured).
        eager: what runs when capture fails (the module's own forward).
        rewrites, verify, method: passed to :func:`fxforge.capture` and :func:`fxforge.rewrite`.

    Example:
        >>> cache = GraphCache(torch.nn.Linear(2, 2), eager=None)
        >>> _ = cache((torch.ones(1, 2),), {}); cache.last.method
        'fx'
    """

    def __init__(self, module: nn.Module, eager: Callable[..., Any] | None, *, rewrites: Any = "default",
                 verify: bool = True, method: str = "auto"):
        self.module = module
        self.eager = eager if eager is not None else module
        self.rewrites = rewrites
        self.verify = verify
        self.method = method
        self.graphs: dict[Hashable, Captured | None] = {}
        self.executables: dict[Hashable, torch.fx.GraphModule] = {}  # the graphs lowered to their kernels
        self._state: list[torch.Tensor] | None = None  # parameters and buffers, to watch for changes
        self._versions: tuple[int, ...] = ()
        self._eval_keys: set[Hashable] = set()
        self._trained = False
        self.last: Captured | None = None
        self.capturing = False
        self._warned: set[str] = set()

    @contextlib.contextmanager
    def _capturing(self) -> Iterator[None]:
        previous, self.capturing = self.capturing, True
        try:
            yield
        finally:
            self.capturing = previous

    def prepare(self, args: tuple, kwargs: dict) -> Captured | None:
        """Capture and rewrite for this call's signature (or return the cached result).

        Returns None, after one warning per distinct reason, when the module cannot be captured.
        """
        return self._entry(args, kwargs)[0]

    def _entry(self, args: tuple, kwargs: dict) -> tuple[Captured | None, torch.fx.GraphModule | None]:
        training = self.module.training
        key = input_signature(args, kwargs, training)
        if training:
            self._trained = True
        else:
            self._drop_stale_eval_graphs()
        if key in self.graphs:
            return self.graphs[key], self.executables.get(key)
        try:
            with self._capturing():
                captured = capture(self.module, args, self.method, example_kwargs=kwargs, check=self.verify)
                captured = rewrite(captured, self.rewrites, verify=self.verify)
                executable = lower(captured.graph_module)
        except Exception as error:  # noqa: BLE001 - any failure falls back to eager with a warning
            reason = first_line(error) if not str(error).startswith("cannot capture") else str(error)
            if reason not in self._warned:
                self._warned.add(reason)
                warnings.warn(
                    f"fxforge: running {type(self.module).__name__} eagerly for inputs "
                    f"{describe_signature(args, kwargs)}: {reason}",
                    FallbackWarning,
                    stacklevel=4,
                )
            self.graphs[key] = None
            return None, None
        self.graphs[key] = captured
        self.executables[key] = executable
        if not training:
            self._eval_keys.add(key)
            self._versions = tuple(t._version for t in self._watched())
        self.last = captured
        return captured, executable

    def _watched(self) -> list[torch.Tensor]:
        """The module's parameters and buffers (listed once; ``clear()`` lists them again)."""
        if self._state is None:
            self._state = [*self.module.parameters(), *self.module.buffers()]
        return self._state

    def _drop_stale_eval_graphs(self) -> None:
        """Eval graphs hold values computed from the weights (folded BatchNorm, prepacked convolutions):
        drop them when a parameter or buffer changed in place, or after a training-mode call (BatchNorm
        updates its statistics without marking the tensors changed)."""
        versions = tuple(t._version for t in self._watched())
        if (self._trained or versions != self._versions) and self._eval_keys:
            for key in self._eval_keys:
                self.graphs.pop(key, None)
                self.executables.pop(key, None)
            self._eval_keys.clear()
        self._versions, self._trained = versions, False

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        captured, executable = self._entry(args, kwargs)
        if captured is None:
            return self.eager(*args, **kwargs)
        if self._needs_grad(args, kwargs):
            return captured.graph_module(*args, **kwargs)  # fused custom ops carry autograd
        return executable(*args, **kwargs)

    def _needs_grad(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call records gradients (the lowered graph's fused kernels have no autograd)."""
        if not torch.is_grad_enabled():
            return False
        if any(t.requires_grad for t in self._watched()):
            return True
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)

    def clear(self) -> None:
        """Forget every graph (after new weights are loaded, or the module changed)."""
        self.graphs.clear()
        self.executables.clear()
        self._eval_keys.clear()
        self._state = None
        self.last = None

