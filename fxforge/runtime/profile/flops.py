"""Counting the FLOPs a graph's nodes run: torch's ``FlopCounterMode`` with the formulas of the cost model.

The formulas are :mod:`fxforge.core.costs`' (torch's own, plus :data:`~fxforge.core.costs.KERNEL_FLOPS` for
fxforge's fused ops, the oneDNN/cuDNN kernels they lower to and CPU's fused attention), so a profile counts
what the checkpointing and pipeline estimates count. This module registers fxforge's fused ops first, so
their formulas are found.

Example:
    >>> with flop_counter() as counter:
    ...     _ = torch.ops.fxforge.linear_pointwise(torch.ones(2, 8), torch.ones(4, 8), None, None, "add", "relu", [],
    ...                                            "composite")
    >>> counter.get_total_flops() == 2 * 2 * 8 * 4
    True
"""

from __future__ import annotations

from torch.utils.flop_counter import FlopCounterMode

from fxforge.core.costs import kernel_flop_formulas
from fxforge.rewrites import fused_ops  # noqa: F401 - registers torch.ops.fxforge.*

FLOP_FORMULAS = kernel_flop_formulas()
"""The cost model's formulas for the kernels ``FlopCounterMode`` lacks, by op packet (fxforge's fused ops
registered): the FLOPs of their convolution or linear layer (the activation and the residual add, like every
pointwise op, count 0), and CPU's fused attention (``4·B·H·S_q·S_kv·D``, as torch counts the CUDA ones), so
an attention rewritten to ``scaled_dot_product_attention`` keeps the FLOPs of its two matrix products."""


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also knows fxforge's fused ops (:data:`FLOP_FORMULAS`).

    Example:
        >>> x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
        >>> with flop_counter() as counter:
        ...     _ = torch.ops.fxforge.conv_pointwise(x, w, None, [1, 1], [1, 1], [1, 1], 1, None, "add", "relu", [],
        ...                                          "composite")
        >>> counter.get_total_flops() == 2 * 8 * 8 * 9 * 3 * 4
        True
    """
    return FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
