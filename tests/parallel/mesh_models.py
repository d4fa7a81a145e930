"""Models written as users write them, for the parallel-plan tests (importable: the workers unpickle them)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    """Blocks in a ModuleList and a classifier head."""

    def __init__(self, width: int = 64, hidden: int = 256, layers: int = 2, classes: int = 10):
        super().__init__()
        self.layers = nn.ModuleList([Block(width, hidden) for _ in range(layers)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def residual_mlp(seed: int = 0, **sizes: int) -> ResidualMLP:
    torch.manual_seed(seed)
    return ResidualMLP(**sizes)
