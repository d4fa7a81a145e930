"""Int8 linear layers and convolutions as ``torch.library`` ops: weights per output channel, activations per token
(linear, dynamic) or per tensor (convolution, static: calibrated), accumulated in int32, the result in float32.

- ``fxforge::int8_linear(input, weight_q, weight_scale, bias)``: each row of ``input`` (a token) is scaled
  by its own largest magnitude into int8 at call time, multiplied with the int8 weight by ``torch._int_mm``
  (VNNI on CPU), and the int32 sums scaled back by the row's and the output channel's scales, plus the bias.
- ``fxforge::int8_linear_tensor(input, weight_q, weight_scale, bias)``: ``input`` quantized per tensor at call
  time by FBGEMM's prepacked dynamic kernel: faster for small products, coarser; chosen per layer by timing.
- ``fxforge::int8_linear_static(input, weight_q, weight_scale, bias, input_scale, input_zero_point)``: ``input``
  quantized to uint8 with a range calibrated for it, oneDNN's int8 product with the dequantization and bias fused.
- ``fxforge::int8_conv(input, weight_q, weight_scale, bias, stride, padding, dilation, groups, input_scale,
  input_zero_point, activation)``: ``input`` is quantized to uint8 with the scale and zero point calibrated
  for it, and oneDNN's int8 convolution (``onednn::qconv2d_pointwise``, weights prepacked once per weight and
  version and input shape) writes float32 with the dequantization, the bias and a ReLU fused.

Quantized weights are symmetric int8 per output channel (:func:`weight_scale`, :func:`weight_int8`); the
plan folds them from the live float weights, so a changed weight is quantized again. A convolution whose input
reaches beyond its calibrated range quantizes that call in a range widened by whole steps to hold it
(:func:`covering_qparams`; clamping would change the answer by up to the overshoot, far more than rounding
does). The float32 layer runs, on the dequantized weights, for a call whose input holds NaN or an infinity (int8
has no such values; eager's answer is NaN there) and where the kernels cannot run: a convolution not on the CPU
or beyond the widest range, a linear layer on a GPU with 16 rows or fewer or sizes not multiples of 8 (cuBLAS's
int8 product, :func:`int_mm_runs`), or on another device.

Example:
    >>> _ = torch.manual_seed(0)
    >>> x, w, b = torch.randn(4, 64), torch.randn(32, 64), torch.randn(32)
    >>> y = torch.ops.fxforge.int8_linear(x, weight_int8(w), weight_scale(w), b)
    >>> ((y - F.linear(x, w, b)).abs().max() / F.linear(x, w, b).abs().max()).item() < 0.02
    True
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from fxforge.core.tensor_cache import TensorCache
from fxforge.lowering.kernels import packing_key
from fxforge.lowering.postop_probes import _channels_last

QMAX = 127
_TINY = torch.finfo(torch.float32).tiny
# A convolution's input beyond its calibrated range is quantized in a range widened on that side by steps of this
# share of the calibrated width (so few ranges are ever packed), at most WIDEST steps in all; further, or NaN or
# an infinity, runs the float32 convolution for that call. Clamping instead would change the answer by up to the
# overshoot, far more than rounding does.
WIDEN_STEP = 0.25
WIDEST = 40
# oneDNN-prepacked int8 convolution weights, per int8 weight and its version, then per call configuration.
PACKED_INT8 = TensorCache()
# FBGEMM-prepacked int8 weights (and bias) of the per-tensor dynamic linear kernel, per int8 weight and version.
PACKED_DYNAMIC = TensorCache()


def weight_scale(weight: Tensor) -> Tensor:
    """The symmetric int8 scale of each output channel of ``weight`` (float32; a channel of zeros gets 1).

    Example:
        >>> weight_scale(torch.tensor([[1.0, -2.54], [0.0, 0.0]])).tolist()
        [0.019999999552965164, 1.0]
    """
    largest = weight.detach().abs().flatten(1).amax(1)
    return torch.where(largest > 0, largest / QMAX, torch.ones_like(largest)).float()


def weight_int8(weight: Tensor) -> Tensor:
    """``weight`` rounded to int8 in its channels' :func:`weight_scale`.

    Example:
        >>> weight_int8(torch.tensor([[1.0, -2.54], [0.0, 0.0]])).tolist()
        [[50, -127], [0, 0]]
    """
    scale = weight_scale(weight).to(weight.dtype).view(-1, *([1] * (weight.dim() - 1)))
    return torch.round(weight.detach() / scale).clamp_(-QMAX, QMAX).to(torch.int8)


def input_qparams(low: float, high: float) -> tuple[float, int]:
    """The uint8 scale and zero point that cover ``[low, high]`` (widened to hold 0, so that zero padding is exact).

    Example:
        >>> scale, zero = input_qparams(0.0, 5.1)
        >>> round(scale, 6), zero
        (0.02, 0)
        >>> input_qparams(-1.0, 1.0)[1]
        128
    """
    low, high = min(float(low), 0.0), max(float(high), 0.0)
    scale = (high - low) / 255 if high > low else 1.0
    return scale, int(min(255, max(0, round(-low / scale))))


def _dequantized(weight_q: Tensor, scale: Tensor) -> Tensor:
    return weight_q.float() * scale.view(-1, *([1] * (weight_q.dim() - 1)))


def _finite(x: Tensor) -> bool:
    # (one pass; a sum that overflows reads as not finite: float32 then. The sum's test in Python: torch.isfinite
    # of a 0-d tensor is four more ops, 14 us a call)
    return math.isfinite(x.sum().item())


def _dense(x: Tensor) -> Tensor:
    """``x``'s elements as a 1-d view in memory order (a channels-last tensor would be copied by a reduction)."""
    if _channels_last(x):
        return x.permute(0, 2, 3, 1).reshape(-1)
    return x.reshape(-1)


def covering_qparams(x: Tensor, scale: float, zero_point: int) -> tuple[float, int] | None:
    """The uint8 scale and zero point to quantize ``x`` in: the calibrated ones where ``x`` lies in their range,
    else a range widened on the side(s) ``x`` overshoots by whole steps of :data:`WIDEN_STEP` of its width;
    None where ``x`` holds NaN or an infinity, or reaches beyond :data:`WIDEST` steps.

    Example:
        >>> scale, zero = input_qparams(0.0, 1.0)
        >>> covering_qparams(torch.tensor([0.0, 0.5]), scale, zero) == (scale, zero)
        True
        >>> low_high = lambda q: (round(-q[1] * q[0], 2), round((255 - q[1]) * q[0], 2))
        >>> low_high(covering_qparams(torch.tensor([-0.1, 1.3]), scale, zero))   # a step below, two above
        (-0.25, 1.5)
        >>> covering_qparams(torch.tensor([float("nan")]), scale, zero) is None
        True
    """
    low, high = (float(v) for v in torch.aminmax(_dense(x)))
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    calibrated_low, calibrated_high = -zero_point * scale, (255 - zero_point) * scale
    if low >= calibrated_low and high <= calibrated_high:
        return scale, zero_point
    step = WIDEN_STEP * (calibrated_high - calibrated_low)
    below = math.ceil(max(0.0, calibrated_low - low) / step - 1e-9)
    above = math.ceil(max(0.0, high - calibrated_high) / step - 1e-9)
    if below + above > WIDEST:
        return None
    return input_qparams(calibrated_low - below * step, calibrated_high + above * step)


def quantize_uint8(x: Tensor, scale: float, zero_point: int) -> Tensor:
    """``x`` rounded to uint8 in ``scale`` and ``zero_point`` (clamped into 0..255), with its strides.

    ATen's per-tensor quantizer makes one vectorized pass; its quantized tensor's bytes are the uint8 values, so
    they are viewed as such rather than copied (torch's own float -> uint8 conversion is several times slower).
    Where the quantizer is gone (it is deprecated), the same values come from plain ops.

    Example:
        >>> quantize_uint8(torch.tensor([-1.0, 0.0, 0.26, 9.0]), 0.1, 10).tolist()
        [0, 10, 13, 100]
    """
    quantizer = getattr(torch, "quantize_per_tensor", None)
    if quantizer is None:
        return torch.round(torch.add(zero_point, x, alpha=1 / scale)).clamp_(0, 255).to(torch.uint8)
    global _QUANTIZER_WARNED
    if not _QUANTIZER_WARNED:  # (its deprecation warning, once per process: said here, not to the user)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantizer(torch.zeros(1), 1.0, 0, torch.quint8)
        _QUANTIZER_WARNED = True
    q = quantizer(x, scale, zero_point, torch.quint8)
    return torch.empty(0, dtype=torch.uint8, device=x.device).set_(q.untyped_storage(), q.storage_offset(),
                                                                  q.shape, q.stride())


_QUANTIZER_WARNED = False


def int_mm_runs(rows: Tensor, weight_q: Tensor) -> bool:
    """Whether ``torch._int_mm`` multiplies ``rows`` (2-d) by ``weight_q``'s transpose on their device: on the
    CPU any sizes; on CUDA (cuBLAS's int8 product) more than 16 rows, and the inner and output sizes multiples of
    8 (the inner at least 16).

    Example:
        >>> int_mm_runs(torch.zeros(4, 64), torch.zeros(32, 64, dtype=torch.int8))
        True
    """
    if rows.shape[0] == 0 or rows.shape[1] == 0:
        return False
    if rows.device.type == "cpu":
        return True
    if rows.device.type != "cuda":
        return False
    inner, outputs = rows.shape[1], weight_q.shape[0]
    return rows.shape[0] > 16 and inner >= 16 and inner % 8 == 0 and outputs % 8 == 0


def linear_int8(input: Tensor, weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """``linear(input, weight, bias)`` with ``input`` quantized per row at call time and ``weight_q`` an int8
    weight in ``weight_scale`` per output channel (see the module docstring): what ``fxforge::int8_linear``
    runs, called straight from a plan's graph (no custom-op dispatch).

    Example:
        >>> w = torch.tensor([[2.0, 2.0]])
        >>> linear_int8(torch.tensor([[1.0, 1.0]]), weight_int8(w), weight_scale(w), None)
        tensor([[4.]])
    """
    rows = input.reshape(-1, input.shape[-1])
    if not int_mm_runs(rows, weight_q):
        return F.linear(input, _dequantized(weight_q, weight_scale), bias)
    magnitudes = rows.abs()
    largest = magnitudes.amax(-1, keepdim=True)
    if not _finite(largest):
        return F.linear(input, _dequantized(weight_q, weight_scale), bias)
    scale = largest.clamp_min_(_TINY).div_(QMAX)
    rows_q = torch.div(rows, scale, out=magnitudes).round_().to(torch.int8)  # (the magnitudes' memory, reused)
    product = torch._int_mm(rows_q, weight_q.t())
    # The int32 sums become float32 in their own memory (element for element, so in place is safe): a new
    # tensor of the output's size would cost as much again in page faults as the conversion.
    out = product.view(torch.float32)
    out.copy_(product)
    out.mul_(scale)
    if bias is None:
        out.mul_(weight_scale)
    else:
        torch.addcmul(bias, out, weight_scale, out=out)
    return out.view(*input.shape[:-1], weight_q.shape[0])


def dynamic_kernel_exists() -> bool:
    """Whether this torch has the prepacked dynamic int8 linear kernel (``quantized::linear_dynamic``, FBGEMM on
    x86), which :func:`linear_int8_tensor` calls (deprecated with torch's quantized tensors).

    Example:
        >>> isinstance(dynamic_kernel_exists(), bool)
        True
    """
    return hasattr(torch.ops.quantized, "linear_dynamic") and hasattr(torch.ops.quantized, "linear_prepack")


def _packed_dynamic(weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Any:
    def pack() -> Any:
        with warnings.catch_warnings():  # (torch's quantized tensors are deprecated; said once, in the docs)
            warnings.simplefilter("ignore")
            quantized = torch._make_per_channel_quantized_tensor(
                weight_q, weight_scale.double(), torch.zeros(weight_q.shape[0], dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.detach())

    key = (*packing_key(weight_q), *packing_key(weight_scale),
           *((id(bias), *packing_key(bias)) if bias is not None else ()))
    return PACKED_DYNAMIC.get(weight_q, key, pack)


def linear_int8_tensor(input: Tensor, weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """``linear(input, weight, bias)`` with ``input`` quantized per tensor at call time (one scale for the whole
    call, from its range) by FBGEMM's prepacked dynamic int8 kernel (``quantized::linear_dynamic``; weights packed
    once per weight and version): fewer passes around the product than :func:`linear_int8`'s per-token
    quantization, so faster for small products, and coarser; the layer's kernel is chosen by timing
    (:mod:`fxforge.lowering.int8_speed`) and its rounding checked like any other. NaN, an infinity, another
    device or no such kernel: the float32 layer on the dequantized weight.

    Example:
        >>> w = torch.tensor([[2.0, 2.0]])
        >>> linear_int8_tensor(torch.tensor([[1.0, 1.0]]), weight_int8(w), weight_scale(w), None)
        tensor([[4.]])
    """
    if input.device.type != "cpu" or input.numel() == 0 or not dynamic_kernel_exists() or not _finite(input):
        return F.linear(input, _dequantized(weight_q, weight_scale), bias)
    return torch.ops.quantized.linear_dynamic(input.contiguous(), _packed_dynamic(weight_q, weight_scale, bias),
                                              False)


@torch.library.custom_op("fxforge::int8_linear_tensor", mutates_args=())
def int8_linear_tensor(input: Tensor, weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`linear_int8_tensor` as an op with a fake implementation (what a rewritten graph holds).

    Example:
        >>> w = torch.tensor([[2.0, 2.0]])
        >>> torch.ops.fxforge.int8_linear_tensor(torch.tensor([[1.0, 1.0]]), weight_int8(w), weight_scale(w), None)
        tensor([[4.]])
    """
    return linear_int8_tensor(input, weight_q, weight_scale, bias)


@int8_linear_tensor.register_fake
def _int8_linear_tensor_fake(input, weight_q, weight_scale, bias):
    return input.new_empty((*input.shape[:-1], weight_q.shape[0]))


def linear_int8_static(input: Tensor, weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None,
                       input_scale: float, input_zero_point: int) -> Tensor:
    """``linear(input, weight, bias)`` with ``input`` quantized to uint8 with the static ``input_scale`` and
    ``input_zero_point`` calibrated for it (widened for a call that reaches beyond, :func:`covering_qparams`), by
    oneDNN's int8 matrix product (``onednn::qlinear_pointwise``, the dequantization and bias fused, weights
    prepacked once per weight, version and input shape): one pass over the input besides the product, the fewest
    of the three linear kernels. NaN, an infinity, another device: the float32 layer on the dequantized weight.

    Example:
        >>> w = torch.tensor([[2.0, 2.0]])
        >>> scale, zero = input_qparams(0.0, 1.0)
        >>> linear_int8_static(torch.tensor([[1.0, 1.0]]), weight_int8(w), weight_scale(w), None, scale, zero)
        tensor([[4.]])
    """
    rows = input.reshape(-1, input.shape[-1])
    qparams = covering_qparams(rows, input_scale, input_zero_point) \
        if input.device.type == "cpu" and rows.numel() > 0 else None
    if qparams is None:
        return F.linear(input, _dequantized(weight_q, weight_scale), bias)
    scale, zero_point = qparams
    by_shape = PACKED_INT8.get(weight_q, (*packing_key(weight_q), *packing_key(weight_scale)), dict)
    packed = by_shape.get(tuple(rows.shape))
    if packed is None:
        packed = by_shape[tuple(rows.shape)] = torch.ops.onednn.qlinear_prepack(weight_q, list(rows.shape))
    zeros = torch.zeros(weight_q.shape[0], dtype=torch.int64)
    out = torch.ops.onednn.qlinear_pointwise(quantize_uint8(rows.contiguous(), scale, zero_point), scale, zero_point,
                                             packed, weight_scale, zeros, bias, 1.0, 0, torch.float32, "none", [],
                                             "")
    return out.view(*input.shape[:-1], weight_q.shape[0])


@torch.library.custom_op("fxforge::int8_linear_static", mutates_args=())
def int8_linear_static(input: Tensor, weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None,
                       input_scale: float, input_zero_point: int) -> Tensor:
    """:func:`linear_int8_static` as an op with a fake implementation (what a rewritten graph holds).

    Example:
        >>> w = torch.tensor([[2.0, 2.0]])
        >>> torch.ops.fxforge.int8_linear_static(torch.tensor([[1.0, 1.0]]), weight_int8(w), weight_scale(w), None,
        ...                                      *input_qparams(0.0, 1.0))
        tensor([[4.]])
    """
    return linear_int8_static(input, weight_q, weight_scale, bias, input_scale, input_zero_point)


@int8_linear_static.register_fake
def _int8_linear_static_fake(input, weight_q, weight_scale, bias, input_scale, input_zero_point):
    return input.new_empty((*input.shape[:-1], weight_q.shape[0]))


@torch.library.custom_op("fxforge::int8_linear", mutates_args=())
def int8_linear(input: Tensor, weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`linear_int8` as an op with a fake implementation (what a rewritten graph holds).

    Example:
        >>> w = torch.tensor([[2.0, 2.0]])
        >>> torch.ops.fxforge.int8_linear(torch.tensor([[1.0, 1.0]]), weight_int8(w), weight_scale(w), None)
        tensor([[4.]])
    """
    return linear_int8(input, weight_q, weight_scale, bias)


@int8_linear.register_fake
def _int8_linear_fake(input, weight_q, weight_scale, bias):
    return input.new_empty((*input.shape[:-1], weight_q.shape[0]))


def conv_int8(input: Tensor, weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None, stride: Sequence[int],
              padding: Sequence[int], dilation: Sequence[int], groups: int, input_scale: float,
              input_zero_point: int, activation: str) -> Tensor:
    """What ``fxforge::int8_conv`` runs (called straight from a plan's graph): a 2d convolution (then ``activation``, ``"none"`` or ``"relu"``) of ``input`` quantized with the static
    ``input_scale`` and ``input_zero_point`` and an int8 weight in ``weight_scale`` per output channel. The
    output keeps the input's memory format.

    Example:
        >>> x, w = torch.rand(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
        >>> scale, zero = input_qparams(0.0, 1.0)
        >>> y = conv_int8(x, weight_int8(w), weight_scale(w), None, [1, 1], [1, 1], [1, 1], 1, scale, zero, "relu")
        >>> y.shape, bool((y - F.relu(F.conv2d(x, w, padding=1))).abs().max() < 0.1)
        (torch.Size([1, 3, 5, 5]), True)
    """
    qparams = None
    if input.device.type == "cpu" and input.dim() == 4 and input.numel() > 0:
        qparams = covering_qparams(input, input_scale, input_zero_point)
    if qparams is None:
        out = F.conv2d(input, _dequantized(weight_q, weight_scale), bias, stride, padding, dilation, groups)
        return F.relu(out) if activation == "relu" else out
    input_scale, input_zero_point = qparams
    channels_last = _channels_last(input)
    # Packed for the input's shape: oneDNN picks its weight layout by it (a 1x1 convolution over 1024 channels
    # runs 3x faster packed for its shape than packed for none).
    shape = list(input.shape)
    config = (tuple(stride), tuple(padding), tuple(dilation), groups, float(input_scale), int(input_zero_point),
              tuple(shape))
    by_config = PACKED_INT8.get(weight_q, (*packing_key(weight_q), *packing_key(weight_scale)), dict)
    packed = by_config.get(config)
    if packed is None:  # (one per shape: a dynamic plan's sizes each keep theirs)
        packed = by_config[config] = torch.ops.onednn.qconv_prepack(weight_q, weight_scale, input_scale,
                                                                    input_zero_point, stride, padding, dilation,
                                                                    groups, shape)
    quantized = quantize_uint8(input, input_scale, input_zero_point)
    zeros = torch.zeros(weight_q.shape[0], dtype=torch.int64)
    out = torch.ops.onednn.qconv2d_pointwise(quantized, input_scale, input_zero_point, packed, weight_scale, zeros,
                                             bias, stride, padding, dilation, groups, 1.0, 0, torch.float32,
                                             activation, [], "")
    if not channels_last and not out.is_contiguous():
        out = out.contiguous()
    return out


@torch.library.custom_op("fxforge::int8_conv", mutates_args=())
def int8_conv(input: Tensor, weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None, stride: Sequence[int],
              padding: Sequence[int], dilation: Sequence[int], groups: int, input_scale: float,
              input_zero_point: int, activation: str) -> Tensor:
    """:func:`conv_int8` as an op with a fake implementation (what a rewritten graph holds).

    Example:
        >>> x, w = torch.rand(1, 2, 5, 5), torch.randn(3, 2, 1, 1)
        >>> y = torch.ops.fxforge.int8_conv(x, weight_int8(w), weight_scale(w), None, [1, 1], [0, 0], [1, 1], 1,
        ...                                 *input_qparams(0.0, 1.0), "none")
        >>> y.shape
        torch.Size([1, 3, 5, 5])
    """
    return conv_int8(input, weight_q, weight_scale, bias, stride, padding, dilation, groups, input_scale,
                     input_zero_point, activation)


@int8_conv.register_fake
def _int8_conv_fake(input, weight_q, weight_scale, bias, stride, padding, dilation, groups, input_scale,
                    input_zero_point, activation):
    sizes = [(size + 2 * p - d * (k - 1) - 1) // s + 1
             for size, k, s, p, d in zip(input.shape[2:], weight_q.shape[2:], stride, padding, dilation)]
    channels_last = _channels_last(input)
    return torch.empty((input.shape[0], weight_q.shape[0], *sizes), dtype=input.dtype, device=input.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)


# Each op's plain function, for graphs that run rather than export (see :func:`fxforge.lowering.int8.direct_calls`).
DIRECT = {torch.ops.fxforge.int8_linear.default: linear_int8, torch.ops.fxforge.int8_conv.default: conv_int8,
          torch.ops.fxforge.int8_linear_tensor.default: linear_int8_tensor,
          torch.ops.fxforge.int8_linear_static.default: linear_int8_static}
