"""A module that stands for the user's model (an optimized module, auto's eager module, an ONNX Runtime module
that exports the model, a checkpointed training step) reads its ``training`` flag from that model.

``model.train()`` or ``model.eval()`` called on the model itself, not on the module that stands for it, must
be seen there too: the optimized module is the model, not a snapshot of it. ``nn.Module.__init__`` sets
``self.training``, so the flag is a data descriptor with a setter: setting it sets the model's flag (as
``model.training = False`` would), and a module that stands for no model (yet) keeps its own.

Example:
    >>> class Wrapper(torch.nn.Module):
    ...     training = FollowsTraining(lambda self: self.__dict__.get("original"))
    ...     def __init__(self, model):
    ...         super().__init__()
    ...         self.__dict__["original"] = model
    >>> model = torch.nn.Linear(2, 2)
    >>> wrapper = Wrapper(model)
    >>> _ = model.eval(); wrapper.training
    False
    >>> wrapper.training = True; model.training
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class FollowsTraining:
    """The ``training`` flag of a module that stands for a model: read from the model ``model_of(module)``
    returns (None: the module's own flag, kept in its ``__dict__``), and set on it.

    Args:
        model_of: ``module -> the model it stands for, or None`` (it must not read ``module.training``).

    Example:
        >>> class Holder(torch.nn.Module):
        ...     training = FollowsTraining(lambda self: self._modules.get("model"))
        >>> holder = Holder(); holder.training          # no model yet: its own flag, as nn.Module set it
        True
        >>> holder.model = torch.nn.ReLU().eval(); holder.training
        False
    """

    def __init__(self, model_of: Callable[[nn.Module], nn.Module | None]):
        self.model_of = model_of

    def _model(self, module: nn.Module) -> nn.Module | None:
        try:
            return self.model_of(module)
        except (AttributeError, KeyError):  # (inside nn.Module.__init__, before the tables exist)
            return None

    def __get__(self, module: nn.Module | None, owner: type | None = None) -> Any:
        if module is None:
            return self
        model = self._model(module)
        return module.__dict__.get("training", True) if model is None else model.training

    def __set__(self, module: nn.Module, value: bool) -> None:
        model = self._model(module)
        if model is None:
            module.__dict__["training"] = value
        else:
            module.__dict__.pop("training", None)  # (the model's flag is the one read from now on)
            model.training = value
