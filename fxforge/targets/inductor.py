"""The ``inductor`` target: as ``native`` (the same guards, plan cache and live weights), each plan's rewritten
graph compiled by ``torch.compile`` (:mod:`fxforge.lowering.inductor`), conv+activation fusion left to
Inductor; a checkpointed training step's graphs compiled by Inductor too. ``precision="int8"``: the layers that
keep the tolerance quantized as PT2E does and compiled with freezing into oneDNN's int8 kernels
(:mod:`fxforge.lowering.inductor_int8`).

Example:
    >>> INDUCTOR.contract.artifact is None, INDUCTOR.lowering.left_out
    (True, ('conv_activation',))
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fxforge.core.captured import Captured
from fxforge.core.plan import Plan
from fxforge.core.target_cache import compile_rate, device_of, remember_compile_rate
from fxforge.lowering.build import Lowering
from fxforge.lowering.inductor import LEFT_TO_INDUCTOR, inductor_plan
from fxforge.lowering.inductor_int8 import inductor_int8_plan
from fxforge.runtime.race import Entrant
from fxforge.targets.base import Contract, Target, prepared
from fxforge.targets.native import NativeTarget


def _compiled(captured: Captured, dynamic: bool) -> Plan:
    return inductor_plan(captured, dynamic=dynamic)


def _reduced(captured: Captured, dynamic: bool, precision: str, tolerance: Any) -> Plan:
    """The float32 plan, and the int8 one where it keeps the tolerance and is faster (``"auto"``: the same race)."""
    return inductor_int8_plan(captured, inductor_plan(captured, dynamic=dynamic), tolerance, dynamic=dynamic)


class InductorTarget(NativeTarget):
    """torch.compile runs the rewritten graph (see the module docstring)."""

    name = "inductor"
    summary = "the rewritten graph compiled by torch.compile (Inductor)"
    contract = Contract(dynamic="every size: one compiled plan per signature, or one with the dims that change "
                                "dynamic", artifact=None)
    options = ("dynamic_shapes", "max_plans", "precision", "tolerance")
    precisions = ("int8", "auto")
    lowering = Lowering(_compiled, tuned=False, left_out=LEFT_TO_INDUCTOR, reduced=_reduced)
    compiled_training = True

    def write(self, built: nn.Module, path: str, *, dynamic_batch: bool = False) -> Any:
        return Target.write(self, built, path)

    def entrant(self, model: nn.Module, args: tuple, kwargs: dict, options: dict[str, Any],
                shared: dict[str, Any]) -> Entrant:
        device = device_of(args, kwargs, model)

        def estimate() -> float | None:  # from the native graph's size, once it is built
            return shared["nodes"] * compile_rate(device)[0] if "nodes" in shared else None

        def built(module: nn.Module, seconds: float) -> None:
            remember_compile_rate(device, seconds, module.report.nodes_after)

        return Entrant(self.name, lambda: prepared(self.build(model, None, options), args, kwargs),
                       estimate_s=estimate, built=built)


INDUCTOR = InductorTarget()
