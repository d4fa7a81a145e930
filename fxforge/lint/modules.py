"""The torch.nn modules a symbolic trace keeps as calls (``call_module``), read as the ATen op each runs: its name
and its arguments in ATen's order, so a rule reads ``self.drop(x)`` as it reads ``aten.dropout(x, p, train)``.

Example:
    >>> as_op(torch.nn.Dropout(0.2).eval(), "x")
    ('dropout', ('x', 0.2, False))
    >>> as_op(torch.nn.Softmax(dim=1), "x")
    ('softmax', ('x', 1))
    >>> as_op(torch.nn.Identity(), "x") is None
    True
"""

from __future__ import annotations

from typing import Any

from torch import nn

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_LOSSES = {nn.MSELoss: "mse_loss", nn.L1Loss: "l1_loss", nn.SmoothL1Loss: "smooth_l1_loss", nn.HuberLoss: "huber_loss",
           nn.BCELoss: "binary_cross_entropy", nn.BCEWithLogitsLoss: "binary_cross_entropy_with_logits"}
_SIMPLE = {nn.Linear: "linear", nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d", nn.GELU: "gelu",
           nn.SiLU: "silu", nn.LayerNorm: "layer_norm", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.PReLU: "prelu"}


def as_op(module: nn.Module, x: Any) -> tuple[str, tuple] | None:
    """(ATen op name, its arguments with ``x`` as the input) of a torch.nn module called on ``x``; None for a
    module it does not read as one op."""
    if isinstance(module, _DROPOUTS):
        return "dropout", (x, module.p, module.training)
    if isinstance(module, _NORMS):
        training = module.training or module.running_mean is None
        return "batch_norm", (x, module.weight, module.bias, module.running_mean, module.running_var, training,
                              module.momentum, module.eps)
    if isinstance(module, (nn.Softmax, nn.LogSoftmax)):
        return ("softmax" if isinstance(module, nn.Softmax) else "log_softmax"), (x, module.dim)
    if isinstance(module, nn.ReLU):
        return ("relu_" if module.inplace else "relu"), (x,)
    if type(module) in _LOSSES:  # called as loss(input, target): the rule reads both from the call
        return _LOSSES[type(module)], (x,)
    for cls, name in _SIMPLE.items():
        if type(module) is cls:
            return name, (x,)
    return None
