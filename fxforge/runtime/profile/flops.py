"""FLOPs of a graph's nodes, counted by ``torch.utils.flop_counter`` with formulas for fxforge's own ops.

Example:
    >>> with flop_counter() as counter:
    ...     _ = torch.ops.fxforge.linear_pointwise(torch.ones(2, 8), torch.ones(4, 8), None, "relu", [], "composite")
    >>> counter.get_total_flops() == 2 * 2 * 8 * 4
    True
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, sdpa_flop_count

from fxforge.rewrites import fused_ops  # noqa: F401 - registers torch.ops.fxforge.*

aten = torch.ops.aten


def _mm_flops(input_shape: Any, out_features: int) -> int:
    return 2 * math.prod(input_shape[:-1]) * int(input_shape[-1]) * int(out_features)


def _conv_pointwise_flop(input_shape, weight_shape, bias_shape, stride, padding, dilation, groups, other_shape,
                         activation, scalars, kernel, *, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_shape, weight_shape, out_shape)


def _linear_pointwise_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(input_shape, weight_shape[0])


def _mkldnn_conv_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_shape, weight_shape, out_shape)


def _mkldnn_conv_binary_flop(input_shape, other_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_shape, weight_shape, out_shape)


def _mkldnn_linear_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(input_shape, out_shape[-1])


def _cudnn_conv_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_shape, weight_shape, out_shape)


def _sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _flop_formulas() -> dict[Any, Any]:
    import fxforge.rewrites.fused_ops  # noqa: F401 - registers torch.ops.fxforge.*

    formulas: dict[Any, Any] = {
        torch.ops.fxforge.conv_pointwise: _conv_pointwise_flop,
        torch.ops.fxforge.linear_pointwise: _linear_pointwise_flop,
        aten.cudnn_convolution_relu: _cudnn_conv_flop,
        aten.cudnn_convolution_add_relu: _cudnn_conv_flop,
    }
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        # CPU attention's fused kernel: torch counts its CUDA siblings, not it (the same formula as theirs).
        formulas[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_flop
    mkldnn = torch.ops.mkldnn
    if hasattr(mkldnn, "_convolution_pointwise"):
        # The overload packet has two overloads with different argument orders: one formula that looks
        # at which it got (the binary one's second argument is a tensor of the input's rank).
        def conv(*args, out_shape=None, **kwargs):
            if len(args) > 2 and isinstance(args[2], torch.Size) and len(args[2]) == len(args[0]):
                return _mkldnn_conv_binary_flop(*args, out_shape=out_shape)
            return _mkldnn_conv_flop(*args, out_shape=out_shape)

        formulas[mkldnn._convolution_pointwise] = conv
    if hasattr(mkldnn, "_linear_pointwise"):
        formulas[mkldnn._linear_pointwise] = _mkldnn_linear_flop
    return formulas


FLOP_FORMULAS = _flop_formulas()
"""FLOP formulas ``FlopCounterMode`` lacks: fxforge's fused ops and the kernels they lower to (the FLOPs of
their convolution or linear layer; the activation and the residual add, like every pointwise op, count 0),
and CPU's fused attention kernel (``4·B·H·S_q·S_kv·D``, as torch counts the CUDA ones), so an attention
rewritten to ``scaled_dot_product_attention`` keeps the FLOPs of its two matrix products."""


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also knows fxforge's fused ops (:data:`FLOP_FORMULAS`).

    Example:
        >>> x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
        >>> with flop_counter() as counter:
        ...     _ = torch.ops.fxforge.conv_pointwise(x, w, None, [1, 1], [1, 1], [1, 1], 1, None, "relu", [],
        ...                                          "composite")
        >>> counter.get_total_flops() == 2 * 8 * 8 * 9 * 3 * 4
        True
    """
    return FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
