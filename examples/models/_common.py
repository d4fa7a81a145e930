"""Small helpers shared by the example factories (not part of the models themselves)."""

from __future__ import annotations

import torch
from torch import nn


def perturb_norm_stats(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm layer non-trivial statistics and affine parameters.

    Freshly built BatchNorm layers are the identity in eval mode (mean 0, variance 1, weight 1, bias 0),
    which would let a wrong conv+BN fold pass unnoticed. Trained models never look like that, so the
    example factories call this to make their models look trained.

    Args:
        model: The model to modify in place.
        seed: Seed for the random statistics.

    Returns:
        The same model, for chaining.

    Example:
        >>> m = perturb_norm_stats(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
        >>> bool((m[1].running_var != 1).any())
        True
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0.0, 0.2, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
                if m.affine:
                    m.weight.uniform_(0.5, 1.5, generator=g)
                    m.bias.normal_(0.0, 0.1, generator=g)
    return model
