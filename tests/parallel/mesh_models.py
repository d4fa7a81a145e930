"""Models written as users write them, for the parallel-plan tests (importable: the workers unpickle them, and
each worker imports the module a model's class is in: this one imports torch only, where a test module would
bring transformers into every rank)."""

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


class Features(torch.nn.Module):
    """A user's multi-output network: the head's answer and two earlier blocks' features."""

    def __init__(self, width: int = 48):
        super().__init__()
        self.stem = torch.nn.Linear(8, width)
        self.block1 = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
        self.block2 = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
        self.block3 = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        f1 = self.block1(self.stem(x))
        f2 = self.block2(f1)
        return {"logits": self.head(self.block3(f2)), "f1": f1, "f2": f2}


class RecordingSGD(torch.optim.SGD):
    """SGD that appends one line to the file ``record`` at each step: a worker's steps, seen from the test."""

    def __init__(self, params, record: str, lr: float = 0.01):
        super().__init__(params, lr=lr)
        self.record = record

    def step(self, closure=None):
        with open(self.record, "a") as out:
            out.write(f"{sum(p.numel() for g in self.param_groups for p in g['params'])}\n")
        return super().step(closure)


def slow_measurement() -> None:
    """A worker setup: the step whose memory is measured takes half a second more (its meter sleeps on entry),
    so a timed step that included it would show."""
    import sys
    import time

    from fxforge.training.measure import PhaseMeter

    class SlowMeter(PhaseMeter):
        def __enter__(self):
            time.sleep(0.5)
            return super().__enter__()

    sys.modules["__main__"].PhaseMeter = SlowMeter  # the worker runs as ``python -m``: its module is __main__
