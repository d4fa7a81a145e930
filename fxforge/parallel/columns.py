"""A ``Linear`` layer heavier than a pipeline stage, computed in blocks of its output features so that
consecutive stages can share it.

A stage of ``torch.distributed.pipelining`` begins where a submodule is called, so one layer is never
split: GPT-2's LM head over a 50k vocabulary is about 30 % of the model's time, and no split of GPT-2
(12 layers, hidden 768) into 8 stages has a slowest stage below 2.4 times the mean. Computed as
``torch.cat([F.linear(x, W[a:b], bias[a:b]) for each block], -1)``, every block a submodule, the layer
offers a place to split between any two blocks: each output is the same dot product over the input
features, only the matrix multiply is called once per block (float32 results may differ in the last
bits, as any change of the BLAS call's shape can make them).

The blocks hold the layer's own parameters (a block takes its rows with a slice, whose backward writes
its rows of the weight's gradient), so a weight tied to another layer (GPT-2's LM head and token
embedding) stays tied; the engine replicates a parameter to every stage that uses it, and the gradients
of the copies add up, as for any tied weight. Sending the blocks' outputs on to the stage that
concatenates them costs bytes at the link, which the split's cost model counts like any other value.

This is the idea of vocabulary parallelism for pipelines (Yeung et al., 2024: the vocabulary layers make
the first and last stages the bottleneck), here restricted to what ``split_spec`` can express: the blocks
go to consecutive stages.

:func:`fxforge.parallel.restructure.with_column_blocks` makes the model with such layers replaced.

Example:
    >>> layer = torch.nn.Linear(8, 256)
    >>> blocks = ColumnBlocks(layer, 4)
    >>> x = torch.randn(2, 8)
    >>> torch.allclose(blocks(x), layer(x), atol=1e-6), blocks.blocks[2].weight is layer.weight
    (True, True)
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fxforge.core.nodes import named_submodule

ALIGN = 64
"""Block edges fall on multiples of this many output features (whole SIMD rows for the matrix multiply)."""


class ColumnBlock(nn.Module):
    """Output features ``start:stop`` of a ``Linear`` layer, on that layer's own parameters.

    Example:
        >>> layer = torch.nn.Linear(4, 6)
        >>> block = ColumnBlock(layer.weight, layer.bias, 2, 5)
        >>> x = torch.randn(3, 4)
        >>> torch.allclose(block(x), layer(x)[:, 2:5])
        True
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, start: int, stop: int):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.start, self.stop = start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[self.start:self.stop]
        return F.linear(x, self.weight[self.start:self.stop], bias)

    def extra_repr(self) -> str:
        return f"out_features={self.start}:{self.stop}"


class ColumnBlocks(nn.Module):
    """A ``Linear`` layer computed as :class:`ColumnBlock` submodules whose outputs are concatenated; a
    pipeline stage may begin at any block.

    Attributes:
        blocks: the blocks, in the order of the output features.
        in_features, out_features: the layer's.

    Example:
        >>> layer = torch.nn.Linear(16, 256)
        >>> blocks = ColumnBlocks(layer, 3)
        >>> [(b.start, b.stop) for b in blocks.blocks]
        [(0, 128), (128, 192), (192, 256)]
    """

    def __init__(self, linear: nn.Linear, blocks: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        edges = block_edges(linear.out_features, blocks)
        self.blocks = nn.ModuleList(ColumnBlock(linear.weight, linear.bias, a, b) for a, b in itertools.pairwise(edges))

    @property
    def weight(self) -> nn.Parameter:
        """The layer's weight (every block's)."""
        return self.blocks[0].weight

    @property
    def bias(self) -> nn.Parameter | None:
        """The layer's bias (every block's), or None."""
        return self.blocks[0].bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([block(x) for block in self.blocks], dim=-1)


def block_edges(features: int, blocks: int, align: int = ALIGN) -> list[int]:
    """Where ``blocks`` blocks of ``features`` output features begin and end: as equal as whole multiples of
    ``align`` allow (the remainder goes to the first blocks), fewer blocks when there are too few features.

    Example:
        >>> block_edges(50257, 4)
        [0, 12608, 25216, 37760, 50257]
        >>> block_edges(100, 4)
        [0, 64, 100]
    """
    if blocks < 1:
        raise ValueError(f"blocks must be at least 1, got {blocks}")
    chunks = max(1, math.ceil(features / align))
    blocks = min(blocks, chunks)
    per, extra = divmod(chunks, blocks)
    edges = [0]
    for i in range(blocks):
        edges.append(min(features, edges[-1] + (per + (i < extra)) * align))
    return edges


def splittable_linear(model: nn.Module, name: str) -> nn.Linear | None:
    """The ``nn.Linear`` layer called ``name`` in ``model`` that :class:`ColumnBlocks` can compute (its own
    ``forward``, no hooks; not the root, which cannot be replaced), else None.

    Example:
        >>> splittable_linear(torch.nn.Sequential(torch.nn.Linear(2, 2)), "0") is not None
        True
    """
    module = named_submodule(model, name) if name else None
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return None
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return None
    if module.weight.dim() != 2:
        return None
    return module


GRANULARITIES = (2, 4, 6)
"""The block sizes tried, as fractions of a mean stage (1/2, 1/4, 1/6). Finer blocks balance the stages
better but each block adds its own gradient of the whole weight to add up (a slice's backward writes a
zero-filled tensor of the weight's size), and which count balances best is not monotonic: the split is
planned for each and the best kept."""


def column_plans(model: nn.Module, names: list[str], seconds: Any, stages: int) -> list[dict[str, int]]:
    """The ways to split the layers that are heavier than a stage, one per granularity: each unit
    (``names[i]`` begins it, ``seconds[i]`` its forward + backward time) that alone takes more than a mean
    stage's share of the total, where it begins with a splittable ``Linear`` layer, into blocks of at most
    ``1 / g`` of a mean stage for each ``g`` in :data:`GRANULARITIES` (at most ``g * stages`` blocks).
    Empty when no layer is that heavy.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1024))
        >>> column_plans(model, ["", "1"], [1.0, 3.0], stages=2)
        [{'1': 3}, {'1': 6}, {'1': 9}]
    """
    total = float(sum(seconds))
    if stages < 2 or total <= 0:
        return []
    mean = total / stages
    heavy = [(name, cost) for name, cost in zip(names, seconds)
             if cost > mean and splittable_linear(model, name) is not None]
    plans: list[dict[str, int]] = []
    for g in GRANULARITIES:
        plan = {name: min(g * stages, math.ceil(g * cost / mean)) for name, cost in heavy}
        if plan and plan not in plans:
            plans.append(plan)
    return plans
