"""``Captured``: the one value that flows through fxforge's pipeline, and ``LoweredRun``, what it may carry
from a stage that already lowered and ran its graph.

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

from fxforge.core.report import Report
from fxforge.core.verify import graph_fingerprint, inputs_key


@dataclasses.dataclass(frozen=True)
class LoweredRun:
    """A graph lowered and run by a stage that had to do so anyway (autotune times the graph it chooses),
    handed on so that verification does not run it again and lowering does not lower it again.

    Both hold only for the function the graph computed when it was recorded (:meth:`lowers` compares
    :func:`~fxforge.core.verify.graph_fingerprint`), and each output only for the very inputs it was
    computed from, unchanged (:func:`~fxforge.core.verify.inputs_key`).

    Attributes:
        fingerprint: the recorded graph's fingerprint.
        lowered: its lowered form (fused ops as direct kernel calls; see :func:`fxforge.lowering.lower.lower`).
        outputs: ``{i: (inputs key, output)}``: what it returned on the ``i``-th verification input, run
            under ``isolated(..., seed=i)`` with gradients off (as :func:`~fxforge.core.verify.check_same`
            runs it).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU()); x = torch.ones(1)
        >>> run = LoweredRun.record(gm, gm, {0: ((x,), {}, gm(x))})
        >>> run.lowers(gm), run.outputs_for(gm, [((x,), {})])[0].tolist()
        (True, [1.0])
    """

    fingerprint: tuple
    lowered: torch.nn.Module
    outputs: dict

    @classmethod
    def record(cls, graph_module: torch.nn.Module, lowered: torch.nn.Module, runs: dict) -> LoweredRun:
        """The record for ``graph_module`` as it is now; ``runs`` is ``{i: (args, kwargs, output)}``."""
        outputs = {i: (inputs_key(args, kwargs), output) for i, (args, kwargs, output) in runs.items()}
        return cls(graph_fingerprint(graph_module), lowered, outputs)

    def lowers(self, graph_module: torch.nn.Module) -> bool:
        """Whether ``graph_module`` still computes the function that was recorded."""
        return graph_fingerprint(graph_module) == self.fingerprint

    def outputs_for(self, graph_module: torch.nn.Module, inputs: list[tuple[tuple, dict]]) -> dict[int, Any]:
        """``{i: output}`` for the entries of ``inputs`` whose outputs were recorded, if ``graph_module``
        still computes the recorded function; empty otherwise."""
        found = {i: self.outputs[i][1] for i, (args, kwargs) in enumerate(inputs)
                 if i in self.outputs and inputs_key(args, kwargs) == self.outputs[i][0]}
        return found if found and self.lowers(graph_module) else {}


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
        report: what capture and the rewrites did (see :class:`~fxforge.core.report.Report`).
        example_outputs: the model's outputs on the example inputs, as capture's check computed them
            (RNG seed 0, buffers restored), or None; verification compares against them instead of
            running the captured graph once more.
        lowered_run: the graph already lowered and run by autotune (a :class:`LoweredRun`), or None.
        before: for a rewritten graph, the ``Captured`` the rewrites started from (None for a capture).

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
    lowered_run: LoweredRun | None = None
    before: Captured | None = None

    @property
    def example_inputs(self) -> tuple:
        """The positional example inputs."""
        return self.example_args

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.graph_module(*args, **kwargs)

    def replace(self, **changes: Any) -> Captured:
        """A new Captured with some fields changed; this one is left as it is."""
        return dataclasses.replace(self, **changes)
