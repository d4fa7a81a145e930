"""A small U-Net for segmentation: double convs, maxpool down, upsample, skip concatenations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import perturb_norm_stats


class DoubleConv(nn.Sequential):
    """(Conv3x3 -> BN -> ReLU) twice.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.

    Example:
        >>> DoubleConv(3, 16)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 16, 32, 32])
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )


class Up(nn.Module):
    """Upsample 2x, concatenate the skip connection, DoubleConv.

    Args:
        in_channels: Channels of the deeper feature map.
        skip_channels: Channels of the skip connection.
        out_channels: Output channels.
        bilinear: Upsample with ``F.interpolate`` + 1x1 conv instead of a ConvTranspose2d.

    Example:
        >>> up = Up(32, 16, 16)
        >>> up(torch.randn(2, 32, 8, 8), torch.randn(2, 16, 16, 16)).shape
        torch.Size([2, 16, 16, 16])
    """

    def __init__(
        self, in_channels: int, skip_channels: int, out_channels: int, bilinear: bool = False
    ) -> None:
        super().__init__()
        self.bilinear = bilinear
        if bilinear:
            self.up = nn.Conv2d(in_channels, in_channels // 2, 1)
        else:
            self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, 2, stride=2)
        self.conv = DoubleConv(in_channels // 2 + skip_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        if self.bilinear:
            x = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)
        x = self.up(x)
        return self.conv(torch.cat([skip, x], dim=1))


class SmallUNet(nn.Module):
    """A 3-level U-Net producing per-pixel class logits at the input resolution.

    The input height and width must be divisible by 4.

    Args:
        in_channels: Channels of the input image.
        num_classes: Channels of the output segmentation map.
        base: Channels of the first level; each deeper level doubles them.
        bilinear: Upsample with bilinear interpolation instead of transposed convolutions.

    Example:
        >>> model = SmallUNet(in_channels=3, num_classes=2, base=8).eval()
        >>> model(torch.randn(2, 3, 64, 64)).shape
        torch.Size([2, 2, 64, 64])
    """

    def __init__(
        self, in_channels: int = 3, num_classes: int = 2, base: int = 8, bilinear: bool = False
    ) -> None:
        super().__init__()
        self.inc = DoubleConv(in_channels, base)
        self.pool = nn.MaxPool2d(2)
        self.down1 = DoubleConv(base, 2 * base)
        self.down2 = DoubleConv(2 * base, 4 * base)
        self.up1 = Up(4 * base, 2 * base, 2 * base, bilinear)
        self.up2 = Up(2 * base, base, base, bilinear)
        self.head = nn.Conv2d(base, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(self.pool(x1))
        x3 = self.down2(self.pool(x2))
        x = self.up1(x3, x2)
        x = self.up2(x, x1)
        return self.head(x)


def example() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A SmallUNet in eval mode (with trained-looking BN statistics) and 2 64x64 images.

    Example:
        >>> model, (x,) = example()
        >>> model(x).shape
        torch.Size([2, 2, 64, 64])
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = perturb_norm_stats(SmallUNet(in_channels=3, num_classes=2, base=8)).eval()
        x = torch.randn(2, 3, 64, 64)
    return model, (x,)
