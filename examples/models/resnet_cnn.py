"""A small ResNet-style CNN, written the way most users write one."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._common import perturb_norm_stats


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with a residual connection (ResNet-18/34 style).

    Args:
        in_channels: Channels of the input.
        out_channels: Channels of the output.
        stride: Stride of the first conv; when it is not 1 or the width changes, the shortcut is a
            1x1 conv + BN ("downsample").

    Example:
        >>> block = BasicBlock(16, 32, stride=2)
        >>> block(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 32, 4, 4])
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return F.relu(out)


class ResNetCNN(nn.Module):
    """A small ResNet for 3-channel images: stem, stages of BasicBlocks, global pool, linear head.

    Stage ``i`` has ``width * 2**i`` channels; every stage after the first halves the resolution.

    Args:
        width: Channels of the stem and the first stage.
        num_classes: Size of the output.
        blocks: Number of BasicBlocks in each stage.

    Example:
        >>> model = ResNetCNN(width=16, num_classes=10, blocks=(1, 1, 1)).eval()
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, width: int = 16, num_classes: int = 10, blocks: Sequence[int] = (1, 1, 1)) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        layers: list[nn.Module] = []
        channels = width
        for i, n in enumerate(blocks):
            out_channels = width * 2**i
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                layers.append(BasicBlock(channels, out_channels, stride))
                channels = out_channels
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        x = torch.flatten(self.pool(x), 1)
        return self.fc(x)


def example() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A ResNetCNN in eval mode (with trained-looking BN statistics) and a batch of 2 32x32 images.

    Example:
        >>> model, (x,) = example()
        >>> model(x).shape
        torch.Size([2, 10])
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = perturb_norm_stats(ResNetCNN(width=16, num_classes=10, blocks=(1, 1, 1))).eval()
        x = torch.randn(2, 3, 32, 32)
    return model, (x,)
