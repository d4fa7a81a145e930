"""The ``onnxruntime`` target for decorated classes: instances that run in ONNX Runtime once in eval mode.

Example:
    >>> @fxforge.optimize(target="onnxruntime")
    ... class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.sigmoid(x)
    >>> net = Net().eval()
    >>> net(torch.zeros(3)).tolist(), type(net.fxforge_onnxruntime).__name__
    ([0.5, 0.5, 0.5], 'OnnxRuntimeModule')
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from fxforge.exporters.ort_module import OnnxRuntimeModule
from fxforge.runtime.native import decorated_subclass


def onnxruntime_class(cls: type[nn.Module], module_for: Callable[[nn.Module], OnnxRuntimeModule]) -> type[nn.Module]:
    """A subclass of ``cls`` whose instances run in ONNX Runtime once in eval mode.

    An instance exports itself on its first call in eval mode (with that call's inputs) and then runs
    the ONNX session (``instance.fxforge_onnxruntime``); in training mode it runs its own forward, since
    the ONNX file is for inference. The subclass keeps the class's name, module and docstring.

    Args:
        cls: the ``nn.Module`` class.
        module_for: ``instance -> OnnxRuntimeModule`` that exports on its first call
            (:meth:`OnnxRuntimeModule.deferred`; :func:`fxforge.targets.onnxruntime.onnxruntime_module` makes one).

    Example:
        >>> from fxforge.targets.onnxruntime import onnxruntime_module
        >>> Fast = onnxruntime_class(torch.nn.Linear, onnxruntime_module)
        >>> layer = Fast(2, 2).eval()
        >>> isinstance(layer, torch.nn.Linear), layer(torch.ones(1, 2)).shape
        (True, torch.Size([1, 2]))
    """
    eager_forward = cls.forward

    @functools.wraps(eager_forward)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__.setdefault("_fxforge_ort", {"module": None, "exporting": False})
        if state["exporting"] or self.training:
            return eager_forward(self, *args, **kwargs)
        if state["module"] is None:
            state["exporting"] = True
            try:
                module = module_for(self)
                module.prepare(*args, **kwargs)
            finally:
                state["exporting"] = False
            state["module"] = module
        return state["module"](*args, **kwargs)

    def fxforge_onnxruntime(self) -> OnnxRuntimeModule | None:
        state = self.__dict__.get("_fxforge_ort")
        return state["module"] if state else None

    def fxforge_report(self) -> Any:
        module = fxforge_onnxruntime(self)
        return module.report if module is not None else None

    def __getstate__(self):
        state = (super(optimized, self).__getstate__() if hasattr(super(optimized, self), "__getstate__")
                 else self.__dict__).copy()
        state.pop("_fxforge_ort", None)
        return state

    optimized = decorated_subclass(cls, {
        "forward": forward,
        "fxforge_onnxruntime": property(fxforge_onnxruntime, doc="The ONNX Runtime module, once exported."),
        "fxforge_report": property(fxforge_report, doc="What fxforge did before exporting this instance."),
        "__getstate__": __getstate__,
    })
    return optimized
