"""``Captured``: the one value that flows through fxforge's pipeline.

Example:
    >>> import torch, fxforge
    >>> cap = fxforge.capture(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    >>> cap.method, cap.opaque
    ('fx', [])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fxforge.rewrites.report import Report


@dataclasses.dataclass
class Captured:
    """A model captured as a graph, with what is known about it.

    Attributes:
        graph_module: the ``torch.fx.GraphModule``; called like the model, it returns what the model
            returns. Its parameters and buffers are the model's own tensors.
        method: ``"fx"`` (symbolic trace) or ``"export"`` (torch.export, ATen ops).
        opaque: submodules kept as leaves (:class:`~fxforge.capture.fx_trace.OpaqueModule`: name, reason,
            source line).
        example_args, example_kwargs: the inputs it was captured with (shapes are static).
        module: the captured ``nn.Module``.
        training: whether the module was in training mode when captured.
        report: what capture and the rewrites did (see :class:`~fxforge.rewrites.report.Report`).
        example_outputs: the model's outputs on the example inputs, as capture's check computed them
            (RNG seed 0, buffers restored), or None; verification compares against them instead of
            running the captured graph once more.

    Example:
        >>> cap = Captured(torch.fx.symbolic_trace(torch.nn.ReLU()), "fx", [], (torch.ones(1),), {},
        ...                torch.nn.ReLU(), False, Report(method="fx"))
        >>> cap(torch.ones(1)).tolist()
        [1.0]
    """

    graph_module: torch.fx.GraphModule
    method: str
    opaque: list
    example_args: tuple
    example_kwargs: dict
    module: torch.nn.Module
    training: bool
    report: Report
    example_outputs: Any = None

    @property
    def example_inputs(self) -> tuple:
        """The positional example inputs."""
        return self.example_args

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.graph_module(*args, **kwargs)

    def replace(self, **changes: Any) -> Captured:
        """A new Captured with some fields changed; this one is left as it is."""
        return dataclasses.replace(self, **changes)
