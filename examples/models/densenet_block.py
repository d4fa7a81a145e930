"""A small DenseNet: dense blocks that concatenate every earlier feature map, transitions, head."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._common import perturb_norm_stats


class DenseLayer(nn.Module):
    """Pre-activation bottleneck: BN-ReLU-Conv1x1-BN-ReLU-Conv3x3 over the concat of its inputs.

    Args:
        in_channels: Channels of all input feature maps together.
        growth_rate: Channels this layer adds.
        bn_size: Width of the bottleneck, as a multiple of ``growth_rate``.

    Example:
        >>> layer = DenseLayer(24, growth_rate=12)
        >>> layer([torch.randn(2, 16, 8, 8), torch.randn(2, 8, 8, 8)]).shape
        torch.Size([2, 12, 8, 8])
    """

    def __init__(self, in_channels: int, growth_rate: int, bn_size: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, bn_size * growth_rate, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(F.relu(self.norm1(x)))
        return self.conv2(torch.relu(self.norm2(x)))


class DenseBlock(nn.Module):
    """``num_layers`` DenseLayers; each sees the block input and every earlier layer's output.

    Args:
        num_layers: Number of DenseLayers.
        in_channels: Channels of the block input.
        growth_rate: Channels each layer adds; the output has
            ``in_channels + num_layers * growth_rate`` channels.

    Example:
        >>> DenseBlock(3, 16, growth_rate=8)(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 40, 8, 8])
    """

    def __init__(self, num_layers: int, in_channels: int, growth_rate: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DenseLayer(in_channels + i * growth_rate, growth_rate) for i in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, dim=1)


class Transition(nn.Sequential):
    """BN-ReLU-Conv1x1 that shrinks the channels, then 2x2 average pooling.

    Args:
        in_channels: Input channels.
        out_channels: Output channels (usually half of ``in_channels``).

    Example:
        >>> Transition(40, 20)(torch.randn(2, 40, 8, 8)).shape
        torch.Size([2, 20, 4, 4])
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(in_channels, out_channels, 1, bias=False),
            nn.AvgPool2d(2, stride=2),
        )


class DenseNetBlock(nn.Module):
    """A small DenseNet for 3-channel images: stem conv, dense blocks with transitions, head.

    Args:
        growth_rate: Channels each DenseLayer adds.
        block_layers: Number of DenseLayers in each dense block; a transition (halving channels and
            resolution) sits between consecutive blocks.
        num_classes: Size of the output.

    Example:
        >>> model = DenseNetBlock(growth_rate=8, block_layers=(3, 3), num_classes=10).eval()
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self, growth_rate: int = 8, block_layers: Sequence[int] = (3, 3), num_classes: int = 10
    ) -> None:
        super().__init__()
        channels = 2 * growth_rate
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        stages: list[nn.Module] = []
        for i, n in enumerate(block_layers):
            stages.append(DenseBlock(n, channels, growth_rate))
            channels += n * growth_rate
            if i < len(block_layers) - 1:
                stages.append(Transition(channels, channels // 2))
                channels //= 2
        self.features = nn.Sequential(*stages)
        self.norm = nn.BatchNorm2d(channels)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(self.stem(x))
        x = self.norm(x).relu()
        x = F.adaptive_avg_pool2d(x, (1, 1)).flatten(1)
        return self.classifier(x)


def example() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A DenseNetBlock in eval mode (with trained-looking BN statistics) and 2 32x32 images.

    Example:
        >>> model, (x,) = example()
        >>> model(x).shape
        torch.Size([2, 10])
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = perturb_norm_stats(DenseNetBlock(growth_rate=8, block_layers=(3, 3), num_classes=10)).eval()
        x = torch.randn(2, 3, 32, 32)
    return model, (x,)
