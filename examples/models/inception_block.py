"""A small Inception-style network: four branches of very different widths, concatenated."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import perturb_norm_stats


class ConvBNReLU(nn.Module):
    """Conv2d (no bias) + BatchNorm2d + ReLU, the unit every branch is built from.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        kernel_size: Square kernel size; padding keeps the resolution for stride 1.
        stride: Conv stride.

    Example:
        >>> ConvBNReLU(3, 8, 3)(torch.randn(2, 3, 16, 16)).shape
        torch.Size([2, 8, 16, 16])
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 1, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, kernel_size // 2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)), inplace=True)


class InceptionBlock(nn.Module):
    """Four parallel branches (1x1, 1x1->3x3, 1x1->5x5 or 1x1->3x3->3x3, maxpool->1x1), concatenated.

    Args:
        in_channels: Input channels.
        ch1x1: Output channels of the 1x1 branch.
        ch3x3_reduce: Bottleneck channels before the 3x3 conv.
        ch3x3: Output channels of the 3x3 branch.
        ch5x5_reduce: Bottleneck channels before the 5x5 conv (or the two 3x3 convs).
        ch5x5: Output channels of the 5x5 branch.
        pool_proj: Output channels of the pooling branch.
        factorize_5x5: Replace the 5x5 conv by two 3x3 convs (Inception-v2/v3 style).

    Example:
        >>> block = InceptionBlock(32, 16, 24, 32, 4, 8, 8)
        >>> block(torch.randn(2, 32, 16, 16)).shape
        torch.Size([2, 64, 16, 16])
    """

    def __init__(
        self,
        in_channels: int,
        ch1x1: int,
        ch3x3_reduce: int,
        ch3x3: int,
        ch5x5_reduce: int,
        ch5x5: int,
        pool_proj: int,
        factorize_5x5: bool = False,
    ) -> None:
        super().__init__()
        self.branch1 = ConvBNReLU(in_channels, ch1x1, 1)
        self.branch2 = nn.Sequential(
            ConvBNReLU(in_channels, ch3x3_reduce, 1),
            ConvBNReLU(ch3x3_reduce, ch3x3, 3),
        )
        if factorize_5x5:
            self.branch3 = nn.Sequential(
                ConvBNReLU(in_channels, ch5x5_reduce, 1),
                ConvBNReLU(ch5x5_reduce, ch5x5, 3),
                ConvBNReLU(ch5x5, ch5x5, 3),
            )
        else:
            self.branch3 = nn.Sequential(
                ConvBNReLU(in_channels, ch5x5_reduce, 1),
                ConvBNReLU(ch5x5_reduce, ch5x5, 5),
            )
        self.branch4_proj = ConvBNReLU(in_channels, pool_proj, 1)
        self.out_channels = ch1x1 + ch3x3 + ch5x5 + pool_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1(x)
        b2 = self.branch2(x)
        b3 = self.branch3(x)
        b4 = self.branch4_proj(F.max_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b2, b3, b4], 1)


class InceptionNet(nn.Module):
    """A small GoogLeNet-like network: stem, two Inception blocks, maxpool, a third block, head.

    Args:
        width: Channels of the stem; the branch widths scale with it.
        num_classes: Size of the output.
        dropout: Dropout before the classifier.

    Example:
        >>> model = InceptionNet(width=32, num_classes=10).eval()
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, width: int = 32, num_classes: int = 10, dropout: float = 0.2) -> None:
        super().__init__()
        w = width
        self.stem = ConvBNReLU(3, w, 3)
        self.pool1 = nn.MaxPool2d(3, stride=2, padding=1)
        self.block1 = InceptionBlock(w, w // 2, 3 * w // 4, w, w // 8, w // 4, w // 4)
        self.block2 = InceptionBlock(
            self.block1.out_channels, w, w, 3 * w // 2, w // 4, 3 * w // 4, w // 2, factorize_5x5=True
        )
        self.pool2 = nn.MaxPool2d(2)
        self.block3 = InceptionBlock(self.block2.out_channels, 3 * w // 2, w, 2 * w, w // 4, w // 2, w // 2)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(self.block3.out_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.stem(x))
        x = self.block2(self.block1(x))
        x = self.block3(self.pool2(x))
        x = x.mean(dim=(2, 3))
        return self.fc(self.dropout(x))


def example() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """An InceptionNet in eval mode (with trained-looking BN statistics) and 2 32x32 images.

    Example:
        >>> model, (x,) = example()
        >>> model(x).shape
        torch.Size([2, 10])
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = perturb_norm_stats(InceptionNet(width=32, num_classes=10)).eval()
        x = torch.randn(2, 3, 32, 32)
    return model, (x,)
