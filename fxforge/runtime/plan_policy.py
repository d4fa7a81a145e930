"""How an optimized module's plans treat input sizes, and how many it holds: :class:`ShapePolicy` and the
limits a :class:`~fxforge.runtime.plans.PlanCache` keeps to.

Example:
    >>> ShapePolicy(dynamic=False).max_plans == MAX_PLANS
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any

# After this many rebuilds because the model's state changed, the model runs eagerly (with one warning):
# something sets its attributes on every call, and each rebuild costs a capture.
MAX_REBUILDS = 8
# Plans one module holds at most (torch.compile's recompile limit is 8 too); calls no plan serves past it run
# eagerly, after one warning.
MAX_PLANS = 8
# Input signatures remembered as served by a shape-generic plan (the first call of a signature checks the
# plan's shape guard; later ones find it here): the oldest are forgotten past this many.
MAX_SERVED = 4096


@dataclasses.dataclass(frozen=True)
class ShapePolicy:
    """How an optimized module's plans treat input sizes.

    Attributes:
        dynamic: None (as ``torch.compile``): the first call's sizes are static; when a later call differs
            from earlier ones only in sizes, those dims become dynamic and one shape-generic plan serves
            all their sizes. Calls with token inputs (integer or bool tensors of rank >= 2: ids, masks) are
            the exception: their batch and sequence dims (:func:`~fxforge.runtime.signature.token_dims`) are
            dynamic from the first plan, since every request has its own length. True: the first plan is
            shape-generic in every input dim already. False: one plan per input signature.
        dynamic_shapes: torch.export's ``dynamic_shapes`` for the first plan (the user knows the ranges).
        max_plans: plans held at most; calls that no plan serves past it run eagerly, after one warning.

    Example:
        >>> ShapePolicy().max_plans
        8
    """

    dynamic: bool | None = None
    dynamic_shapes: Any = None
    max_plans: int = MAX_PLANS
