"""Branchy networks for memory-aware scheduling: where the order of the nodes decides the peak memory.

- :class:`RandWireNet`: a randomly wired network (Watts–Strogatz graph made acyclic, every node
  ``relu(conv(concat(inputs)))`` with its own width);
- :class:`WideInception`: Inception blocks whose branches have very different widths (a wide bottleneck
  with a narrow result beside a narrow bottleneck with a wide one);
- :class:`CellNet`: DARTS/NASNet-style cells (every node the sum of two operations on earlier nodes, the
  cell's output the concatenation of its nodes);
- :func:`synthetic_2000`: a stack of randomly wired stages, about 2 000 graph nodes, for timing the
  scheduler.

:data:`BRANCHY` maps a short name to each factory ``() -> (model, example_inputs)``; it also lists the
existing Inception, U-Net, DenseNet, transformer and ResNet examples (the last four are chains, where no
gain is expected). It is kept apart from ``examples.models.EXAMPLES`` so the corpus and benchmark tables
built on that stay as they are.

Example:
    >>> model, (x,) = BRANCHY["randwire_n16"]()
    >>> model(x).shape
    torch.Size([1, 10])
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import densenet_block, inception_block, resnet_cnn, transformer_encoder, unet

# --------------------------------------------------------------------------------------------------
# randomly wired networks


def watts_strogatz_dag(n: int, k: int = 4, p: float = 0.75, seed: int = 0) -> list[list[int]]:
    """A Watts–Strogatz small-world graph on ``n`` nodes, edges oriented from lower to higher index.

    Start from a ring where each node links to its ``k // 2`` nearest neighbours on each side; then each
    edge ``(i, i + j)`` is, with probability ``p``, moved to a random other end ``w`` (no self-loops, no
    duplicate edges). Orienting every edge from the lower to the higher index makes the graph acyclic.

    Returns:
        ``preds``: for each node, the sorted indices of its inputs (empty for sources).

    Example:
        >>> preds = watts_strogatz_dag(8, k=4, p=0.0)
        >>> preds[2], preds[7]   # a ring lattice: each node linked to its two neighbours on each side
        ([0, 1], [0, 1, 5, 6])
    """
    rng = random.Random(seed)
    adjacent: list[set[int]] = [set() for _ in range(n)]
    for i in range(n):
        for j in range(1, k // 2 + 1):
            adjacent[i].add((i + j) % n)
            adjacent[(i + j) % n].add(i)
    for j in range(1, k // 2 + 1):
        for i in range(n):
            if rng.random() >= p:
                continue
            v = (i + j) % n
            if v not in adjacent[i]:
                continue
            choices = [w for w in range(n) if w != i and w not in adjacent[i]]
            if not choices:
                continue
            w = rng.choice(choices)
            adjacent[i].discard(v)
            adjacent[v].discard(i)
            adjacent[i].add(w)
            adjacent[w].add(i)
    return [sorted(u for u in adjacent[v] if u < v) for v in range(n)]


class RandWireStage(nn.Module):
    """One randomly wired stage: node ``i`` computes ``relu(conv3x3(concat(its inputs)))``.

    Sources read the stage input; the sinks' outputs are concatenated and mixed by a 1x1 conv.

    Args:
        in_channels: Channels of the stage input.
        out_channels: Channels of the stage output.
        preds: The graph, as returned by :func:`watts_strogatz_dag`.
        widths: Output channels of each node.
        kernel_size: Kernel of the node convolutions.

    Example:
        >>> stage = RandWireStage(8, 16, [[], [0], [0, 1]], [4, 8, 16])
        >>> stage(torch.randn(1, 8, 8, 8)).shape
        torch.Size([1, 16, 8, 8])
    """

    def __init__(self, in_channels: int, out_channels: int, preds: Sequence[Sequence[int]],
                 widths: Sequence[int], kernel_size: int = 3) -> None:
        super().__init__()
        self.preds = [list(p) for p in preds]
        users = {u for p in self.preds for u in p}
        self.sinks = [v for v in range(len(self.preds)) if v not in users]
        self.convs = nn.ModuleList()
        for v, p in enumerate(self.preds):
            fan_in = sum(widths[u] for u in p) if p else in_channels
            self.convs.append(nn.Conv2d(fan_in, widths[v], kernel_size, padding=kernel_size // 2))
        self.out = nn.Conv2d(sum(widths[v] for v in self.sinks), out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values: list[torch.Tensor] = []
        for conv, p in zip(self.convs, self.preds):
            if not p:
                inp = x
            elif len(p) == 1:
                inp = values[p[0]]
            else:
                inp = torch.cat([values[u] for u in p], dim=1)
            values.append(F.relu(conv(inp)))
        sinks = [values[v] for v in self.sinks]
        return F.relu(self.out(torch.cat(sinks, dim=1) if len(sinks) > 1 else sinks[0]))


class RandWireNet(nn.Module):
    """A stem conv, randomly wired stages (Watts–Strogatz, k = 4, p = 0.75), global pool, linear head.

    Every node has its own width, drawn from ``widths`` with the stage's seed, so that which values are
    alive together matters.

    Args:
        nodes: Nodes of each stage.
        seed: Seed of the first stage's graph and widths (stage ``i`` uses ``seed + i``).
        channels: Channels of the stem and of each stage's output.
        widths: The widths node widths are drawn from.
        k, p: Watts–Strogatz parameters.
        kernel_size: Kernel of the node convolutions.
        num_classes: Size of the output.

    Example:
        >>> model = RandWireNet(nodes=(8,), seed=1).eval()
        >>> model(torch.randn(1, 3, 16, 16)).shape
        torch.Size([1, 10])
    """

    def __init__(self, nodes: Sequence[int] = (16,), seed: int = 0, channels: int = 16,
                 widths: Sequence[int] = (4, 8, 16, 32, 64), k: int = 4, p: float = 0.75,
                 kernel_size: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        stages = []
        for i, n in enumerate(nodes):
            rng = random.Random(1000 + seed + i)
            stage_widths = [rng.choice(list(widths)) for _ in range(n)]
            preds = watts_strogatz_dag(n, k, p, seed + i)
            stages.append(RandWireStage(channels, channels, preds, stage_widths, kernel_size))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


# --------------------------------------------------------------------------------------------------
# Inception blocks with branches of very different widths


class WideBranchBlock(nn.Module):
    """Four branches concatenated, written in this order: a 1x1 conv; a 1x1 conv to a narrow bottleneck
    then a 3x3 conv to a wide result; a 1x1 conv to a wide bottleneck then a 3x3 conv to a narrow result;
    3x3 max-pool then a 1x1 conv.

    Run as written, the second branch's wide result is alive while the third branch's wide bottleneck
    is computed; running the third branch first avoids that.

    Args:
        in_channels: Input channels.
        narrow: Channels of the narrow tensors.
        wide: Channels of the wide result.
        bottleneck: Channels of the wide bottleneck.

    Example:
        >>> WideBranchBlock(16, 4, 64, 128)(torch.randn(1, 16, 8, 8)).shape
        torch.Size([1, 80, 8, 8])
    """

    def __init__(self, in_channels: int, narrow: int, wide: int, bottleneck: int) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(in_channels, narrow, 1)
        self.wide_out_reduce = nn.Conv2d(in_channels, narrow, 1)
        self.wide_out = nn.Conv2d(narrow, wide, 3, padding=1)
        self.wide_mid_reduce = nn.Conv2d(in_channels, bottleneck, 1)
        self.wide_mid = nn.Conv2d(bottleneck, narrow, 3, padding=1)
        self.pool_proj = nn.Conv2d(in_channels, 2 * narrow, 1)
        self.out_channels = narrow + wide + narrow + 2 * narrow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = F.relu(self.b1(x))
        b2 = F.relu(self.wide_out(F.relu(self.wide_out_reduce(x))))
        b3 = F.relu(self.wide_mid(F.relu(self.wide_mid_reduce(x))))
        b4 = F.relu(self.pool_proj(F.max_pool2d(x, 3, stride=1, padding=1)))
        return torch.cat([b1, b2, b3, b4], dim=1)


class WideInception(nn.Module):
    """A stem and a stack of :class:`WideBranchBlock`, each followed by a 1x1 conv back to ``channels``.

    Args:
        blocks: Number of blocks.
        channels: Channels between blocks.
        narrow, wide, bottleneck: Branch widths.
        num_classes: Size of the output.

    Example:
        >>> WideInception(blocks=2).eval()(torch.randn(1, 3, 16, 16)).shape
        torch.Size([1, 10])
    """

    def __init__(self, blocks: int = 4, channels: int = 16, narrow: int = 8, wide: int = 64,
                 bottleneck: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        layers: list[nn.Module] = []
        for _ in range(blocks):
            block = WideBranchBlock(channels, narrow, wide, bottleneck)
            layers += [block, nn.Conv2d(block.out_channels, channels, 1), nn.ReLU()]
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


# --------------------------------------------------------------------------------------------------
# DARTS / NASNet-style cells


class SepConv(nn.Sequential):
    """ReLU, depthwise kxk conv, pointwise conv, twice (the separable conv of NAS search spaces).

    Example:
        >>> SepConv(8, 3)(torch.randn(1, 8, 8, 8)).shape
        torch.Size([1, 8, 8, 8])
    """

    def __init__(self, channels: int, kernel_size: int, dilation: int = 1, repeats: int = 2) -> None:
        layers: list[nn.Module] = []
        pad = dilation * (kernel_size // 2)
        for _ in range(repeats):
            layers += [nn.ReLU(), nn.Conv2d(channels, channels, kernel_size, padding=pad, dilation=dilation,
                                            groups=channels, bias=False),
                       nn.Conv2d(channels, channels, 1, bias=False)]
        super().__init__(*layers)


def _cell_op(name: str, channels: int) -> nn.Module:
    if name == "sep3":
        return SepConv(channels, 3)
    if name == "sep5":
        return SepConv(channels, 5)
    if name == "dil3":
        return SepConv(channels, 3, dilation=2, repeats=1)
    if name == "max3":
        return nn.MaxPool2d(3, stride=1, padding=1)
    if name == "avg3":
        return nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
    if name == "skip":
        return nn.Identity()
    raise ValueError(f"unknown cell op {name!r}")


# Each step: two (operation, input) pairs; inputs 0 and 1 are the cell inputs, 2.. earlier steps.
DARTS_LIKE = [(("sep3", 0), ("sep3", 1)), (("sep3", 1), ("dil3", 0)), (("sep5", 2), ("skip", 0)),
              (("max3", 1), ("dil3", 3))]
NASNET_LIKE = [(("sep5", 1), ("sep3", 0)), (("avg3", 1), ("skip", 1)), (("sep3", 0), ("avg3", 0)),
               (("sep5", 0), ("sep3", 1)), (("avg3", 2), ("sep3", 3))]


class Cell(nn.Module):
    """A NAS cell: both inputs mapped to ``channels`` by 1x1 convs, then each step sums two operations on
    earlier states; the output concatenates the steps' states (NASNet-style: only those no step used).

    Args:
        in0, in1: Channels of the two inputs (the outputs of the two previous cells).
        channels: Channels of every state.
        genotype: Steps, e.g. :data:`DARTS_LIKE`.
        concat_unused: Concatenate only the states no step used (NASNet) instead of all steps (DARTS).

    Example:
        >>> cell = Cell(8, 8, 4, DARTS_LIKE)
        >>> cell(torch.randn(1, 8, 8, 8), torch.randn(1, 8, 8, 8)).shape
        torch.Size([1, 16, 8, 8])
    """

    def __init__(self, in0: int, in1: int, channels: int, genotype: Sequence, concat_unused: bool = False) -> None:
        super().__init__()
        self.pre0 = nn.Sequential(nn.ReLU(), nn.Conv2d(in0, channels, 1, bias=False))
        self.pre1 = nn.Sequential(nn.ReLU(), nn.Conv2d(in1, channels, 1, bias=False))
        self.inputs = [(a[1], b[1]) for a, b in genotype]
        self.ops = nn.ModuleList(nn.ModuleList([_cell_op(a[0], channels), _cell_op(b[0], channels)])
                                 for a, b in genotype)
        used = {i for pair in self.inputs for i in pair}
        steps = range(2, 2 + len(genotype))
        self.concat = [s for s in steps if s not in used] if concat_unused else list(steps)
        self.out_channels = channels * len(self.concat)

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        states = [self.pre0(s0), self.pre1(s1)]
        for (op_a, op_b), (a, b) in zip(self.ops, self.inputs):
            states.append(op_a(states[a]) + op_b(states[b]))
        return torch.cat([states[i] for i in self.concat], dim=1)


class CellNet(nn.Module):
    """A stem and ``cells`` NAS cells, each reading the outputs of the two cells before it.

    Args:
        cells: Number of cells.
        channels: Channels of each cell's states.
        genotype: The cell, :data:`DARTS_LIKE` or :data:`NASNET_LIKE`.
        concat_unused: See :class:`Cell`.
        num_classes: Size of the output.

    Example:
        >>> CellNet(cells=2).eval()(torch.randn(1, 3, 16, 16)).shape
        torch.Size([1, 10])
    """

    def __init__(self, cells: int = 4, channels: int = 16, genotype: Sequence = DARTS_LIKE,
                 concat_unused: bool = False, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        prev0 = prev1 = channels
        self.cells = nn.ModuleList()
        for _ in range(cells):
            cell = Cell(prev0, prev1, channels, genotype, concat_unused)
            self.cells.append(cell)
            prev0, prev1 = prev1, cell.out_channels
        self.head = nn.Linear(prev1, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.head(s1.mean(dim=(2, 3)))


# --------------------------------------------------------------------------------------------------
# factories


def _seeded(build: Callable[[], nn.Module], shape: tuple[int, ...]) -> tuple[nn.Module, tuple[torch.Tensor]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build().eval()
        x = torch.randn(*shape)
    return model, (x,)


def randwire(n: int, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A one-stage :class:`RandWireNet` with ``n`` nodes and one 1x3x32x32 image.

    Example:
        >>> model, (x,) = randwire(16)
        >>> model(x).shape
        torch.Size([1, 10])
    """
    return _seeded(lambda: RandWireNet(nodes=(n,), seed=seed), (1, 3, 32, 32))


def wide_inception() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A :class:`WideInception` of 4 blocks (8, 64 and 128 channels) and one 1x3x32x32 image.

    Example:
        >>> model, (x,) = wide_inception()
        >>> model(x).shape
        torch.Size([1, 10])
    """
    return _seeded(lambda: WideInception(blocks=4, channels=16, narrow=8, wide=64, bottleneck=128), (1, 3, 32, 32))


def darts_cells() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A :class:`CellNet` of 4 DARTS-like cells (16 channels) and one 1x3x32x32 image.

    Example:
        >>> model, (x,) = darts_cells()
        >>> model(x).shape
        torch.Size([1, 10])
    """
    return _seeded(lambda: CellNet(cells=4, channels=16, genotype=DARTS_LIKE), (1, 3, 32, 32))


def nasnet_cells() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A :class:`CellNet` of 4 NASNet-like cells (16 channels, unused states concatenated), 1x3x32x32.

    Example:
        >>> model, (x,) = nasnet_cells()
        >>> model(x).shape
        torch.Size([1, 10])
    """
    return _seeded(lambda: CellNet(cells=4, channels=16, genotype=NASNET_LIKE, concat_unused=True),
                   (1, 3, 32, 32))


def synthetic_2000() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """About 2 000 graph nodes: 32 randomly wired stages of 16–32 nodes (1x1 convs, 4x4 images).

    For timing the scheduler; the convolutions are tiny, so the graph itself runs in milliseconds.

    Example:
        >>> model, (x,) = synthetic_2000()
        >>> len(model.stages)
        32
    """
    rng = random.Random(2000)
    nodes = tuple(rng.randint(16, 32) for _ in range(32))
    return _seeded(lambda: RandWireNet(nodes=nodes, seed=7, channels=8, widths=(2, 4, 8, 16), kernel_size=1),
                   (1, 3, 4, 4))


BRANCHY: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "randwire_n16": lambda: randwire(16, seed=0),
    "randwire_n24": lambda: randwire(24, seed=1),
    "randwire_n32": lambda: randwire(32, seed=2),
    "wide_inception": wide_inception,
    "darts_cells": darts_cells,
    "nasnet_cells": nasnet_cells,
    "inception": inception_block.example,
    "unet": unet.example,
    "densenet": densenet_block.example,
    "transformer_encoder": transformer_encoder.example,
    "resnet_cnn": resnet_cnn.example,
    "synthetic_2000": synthetic_2000,
}
"""Name -> factory of the scheduling corpus (the last entry is for timing only)."""
