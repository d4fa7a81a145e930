"""``conv_bn_fold``: a convolution or linear layer followed by an eval-mode BatchNorm becomes one layer.

BatchNorm in eval mode is an affine map per channel, ``y = (x - mean) / sqrt(var + eps) * gamma + beta``,
so after a convolution it folds into the convolution's weights and bias:
``w' = w * scale`` and ``b' = (b - mean) * scale + beta`` with ``scale = gamma / sqrt(var + eps)``.

The rules, top to bottom (one per dimensionality; each pattern matches ``nn.ConvNd``/``F.convNd``/
``aten.convNd``/``aten.convolution``, with or without bias, followed by ``nn.BatchNormNd``/
``F.batch_norm``/``aten.batch_norm``/``aten._native_batch_norm_legit_no_training``):

- conv1d + batch_norm → conv1d with folded weights
- conv2d + batch_norm → conv2d with folded weights
- conv3d + batch_norm → conv3d with folded weights
- linear + batch_norm → linear with folded weights (a 2-d input: BatchNorm1d's channels are the features)
- linear + flatten + batch_norm (+ reshape_as the linear output) → linear with folded weights (then the
  flatten); LeViT's ``MLPLayerWithBN`` is ``bn(y.flatten(0, 1)).reshape_as(y)`` with ``y = linear(x)``

The folded weights are new tensors registered on the GraphModule (computed in float64); the model's
own parameters are never modified. The rule refuses, with the reason in the report, BatchNorm using
batch statistics (training mode), BatchNorm without running statistics, channel counts that do not line
up, and (by the engine) a convolution whose output is also used elsewhere.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    >>> new = fxforge.rewrite(fxforge.capture(model, (torch.randn(1, 3, 8, 8),)), ["conv_bn_fold"])
    >>> new.report.counts
    {'conv_bn_fold': 1}
"""

from __future__ import annotations

import torch
from torch import nn

from fxforge.rewrites.passes import Refusal
from fxforge.rewrites.pattern import Match, Rule, rules_pass

F = nn.functional
CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def refuse_unfoldable(match: Match, layer: str = "convolution") -> Refusal | None:
    """Why the BatchNorm cannot be folded into the convolution, or None.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); _ = g.output(x)
        >>> m = Match(torch.fx.GraphModule(torch.nn.Module(), g), {"mean": None, "training": False}, [x])
        >>> str(refuse_unfoldable(m))
        'BatchNorm has no running statistics (track_running_stats=False)'
    """
    if match["mean"] is None or match["var"] is None:
        return Refusal("BatchNorm has no running statistics (track_running_stats=False)")
    if match["training"]:
        return Refusal("BatchNorm uses batch statistics in training mode; folding needs eval mode")
    weight, mean, var = match.tensor("w"), match.tensor("mean"), match.tensor("var")
    if weight is None or mean is None or var is None:
        return Refusal(f"no shape metadata for the {layer} weight or the BatchNorm statistics")
    channels = weight.shape[0]
    others = [match.tensor(k) for k in ("b", "gamma", "beta") if match[k] is not None]
    if any(t is None or tuple(t.shape) != (channels,) for t in [mean, var, *others]):
        return Refusal(f"BatchNorm parameters do not have the {layer}'s {channels} output channels")
    if any(not t.is_floating_point() for t in [weight, mean, var, *others]):
        return Refusal(f"non-floating-point {layer} or BatchNorm tensors")
    return None


def conv_bn_rule(dims: int) -> Rule:
    """The fold rule for ``dims``-dimensional convolutions (1, 2 or 3).

    Example:
        >>> conv_bn_rule(2).name
        'conv2d + batch_norm'
    """
    conv = CONVS[dims]

    def pattern(x, w, b, stride, padding, dilation, groups, mean, var, gamma, beta, training, momentum, eps):
        y = conv(x, w, b, stride, padding, dilation, groups)
        return F.batch_norm(y, mean, var, gamma, beta, training, momentum, eps)

    def replacement(x, w, b, stride, padding, dilation, groups, mean, var, gamma, beta, training, momentum, eps):
        scale = torch.rsqrt(var + eps) if gamma is None else gamma * torch.rsqrt(var + eps)
        shift = -mean * scale if b is None else (b - mean) * scale
        shift = shift if beta is None else shift + beta
        folded = w * scale.reshape([-1] + [1] * (dims + 1))
        return conv(x, folded, shift, stride, padding, dilation, groups)

    return Rule(f"conv{dims}d + batch_norm", pattern, replacement, check=refuse_unfoldable, fold=True,
                description=f"conv{dims}d followed by eval-mode BatchNorm -> one conv{dims}d with folded weights")


def refuse_unfoldable_linear(match: Match) -> Refusal | None:
    """Why the BatchNorm cannot be folded into the linear layer, or None: the convolution's reasons, and a
    BatchNorm input that is not 2-d with the features as its channels (BatchNorm1d normalizes dim 1).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); _ = g.output(x)
        >>> m = Match(torch.fx.GraphModule(torch.nn.Module(), g), {"mean": None, "training": False}, [x])
        >>> str(refuse_unfoldable_linear(m))
        'BatchNorm has no running statistics (track_running_stats=False)'
    """
    refusal = refuse_unfoldable(match, "linear layer")
    if refusal is not None:
        return refusal
    normalized = match.ops["batch_norm"].args["input"]
    value = normalized.meta.get("val") if isinstance(normalized, torch.fx.Node) else None
    features = match.tensor("w").shape[0]
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] != features:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else "unknown"
        return Refusal(f"BatchNorm normalizes dim 1 of a {shape} value, not the linear layer's {features} features")
    return None


def linear_bn_rule(form: str) -> Rule:
    """The fold rule for a linear layer then BatchNorm: directly (``form=""``), through a ``flatten``
    (``"flatten"``), or through a flatten with the result reshaped back as the linear output (``"reshape_as"``).

    Example:
        >>> linear_bn_rule("flatten").name
        'linear + flatten + batch_norm'
    """

    def folded(x, w, b, mean, var, gamma, beta, eps):
        scale = torch.rsqrt(var + eps) if gamma is None else gamma * torch.rsqrt(var + eps)
        shift = -mean * scale if b is None else (b - mean) * scale
        shift = shift if beta is None else shift + beta
        return F.linear(x, w * scale.reshape(-1, 1), shift)

    def pattern(x, w, b, mean, var, gamma, beta, training, momentum, eps):
        return F.batch_norm(F.linear(x, w, b), mean, var, gamma, beta, training, momentum, eps)

    def replacement(x, w, b, mean, var, gamma, beta, training, momentum, eps):
        return folded(x, w, b, mean, var, gamma, beta, eps)

    def flattened_pattern(x, w, b, start, end, mean, var, gamma, beta, training, momentum, eps):
        y = torch.flatten(F.linear(x, w, b), start, end)
        return F.batch_norm(y, mean, var, gamma, beta, training, momentum, eps)

    def flattened_replacement(x, w, b, start, end, mean, var, gamma, beta, training, momentum, eps):
        return torch.flatten(folded(x, w, b, mean, var, gamma, beta, eps), start, end)

    def restored_pattern(x, w, b, start, end, mean, var, gamma, beta, training, momentum, eps):
        y = F.linear(x, w, b)
        return F.batch_norm(torch.flatten(y, start, end), mean, var, gamma, beta, training, momentum, eps).reshape_as(y)

    def restored_replacement(x, w, b, start, end, mean, var, gamma, beta, training, momentum, eps):
        return folded(x, w, b, mean, var, gamma, beta, eps)

    forms = {"": (pattern, replacement), "flatten": (flattened_pattern, flattened_replacement),
             "reshape_as": (restored_pattern, restored_replacement)}
    name = {"": "linear + batch_norm", "flatten": "linear + flatten + batch_norm",
            "reshape_as": "linear + flatten + batch_norm + reshape_as"}[form]
    return Rule(name, *forms[form], check=refuse_unfoldable_linear, fold=True,
                description=f"{name} (eval mode) -> one linear layer with folded weights")


RULES: list[Rule] = [conv_bn_rule(1), conv_bn_rule(2), conv_bn_rule(3), linear_bn_rule(""),
                     linear_bn_rule("reshape_as"), linear_bn_rule("flatten")]

CONV_BN_FOLD = rules_pass("conv_bn_fold", RULES,
                          "fold eval-mode BatchNorm into the convolution (1d/2d/3d) or linear layer before it")
