"""Example user models: plain PyTorch, written the way users write them.

Each module has one public model class and an ``example()`` factory returning ``(model, example_inputs)``
with a small-but-real configuration (the model in eval mode). :data:`EXAMPLES` maps a short name to
each factory.

Example:
    >>> from examples.models import EXAMPLES
    >>> model, inputs = EXAMPLES["resnet_cnn"]()
    >>> model(*inputs).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import densenet_block, inception_block, resnet_cnn, transformer_encoder, unet
from .densenet_block import DenseNetBlock
from .inception_block import InceptionNet
from .resnet_cnn import ResNetCNN
from .transformer_encoder import TransformerEncoder
from .unet import SmallUNet

EXAMPLES: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "resnet_cnn": resnet_cnn.example,
    "densenet": densenet_block.example,
    "inception": inception_block.example,
    "unet": unet.example,
    "transformer_encoder": transformer_encoder.example,
}

__all__ = ["EXAMPLES", "DenseNetBlock", "InceptionNet", "ResNetCNN", "SmallUNet", "TransformerEncoder"]
