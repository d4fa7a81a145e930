"""The ranges a static int8 plan quantizes its layers' inputs in (:func:`observe_inputs`, the observers of static
quantization): fitted to the values met on the calibration calls, not their extremes.

A layer's input quantized to uint8 in ``[a, b]`` loses two things: every value inside is rounded to a step of
``s = (b - a) / 255`` (a squared error of ``s**2 / 12`` on average), and every value outside is clamped to the
nearest end. The observed minimum and maximum lose nothing to clamping, but one large value (a GELU's tail, a
LayerNorm's outlier) stretches the step for all the others: ViT-small's inputs round to a step several times what
most of their values need. :func:`fitted_range` takes the range of least expected squared error over a histogram
of the values met, as PyTorch's ``HistogramObserver`` does for PT2E's static quantization (there by a greedy
search over its bins; here every candidate pair of edges is priced at once, from prefix sums). The plan's
tolerance check is what answers for the values clamped: a range that clamps too much breaks it, and the layer
stays in float32 (``fxforge.lowering.precision_choice``).

Example:
    >>> _ = torch.manual_seed(0)
    >>> values = torch.cat([torch.randn(1_000_000), torch.tensor([40.0])])  # one outlier
    >>> low, high = fitted_range(torch.histc(values, BINS, values.min().item(), 40.0), values.min().item(), 40.0)
    >>> -5.0 < low < -3.0 and 3.0 < high < 20.0  # the outlier is clamped; the other values' step is a third
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node

from fxforge.lowering.int8 import _argument

BINS = 2048  # the histogram's bins over a layer input's observed range
CANDIDATES = 512  # candidate edges on each side of zero, at most


def fitted_range(histogram: torch.Tensor, low: float, high: float) -> tuple[float, float]:
    """The range ``[a, b]`` (``low <= a <= 0 <= b <= high``, edges of the histogram's bins or 0) whose uint8
    quantization of values counted by ``histogram`` (equal bins over ``[low, high]``, each value taken at its
    bin's centre) has the least expected squared error: rounding inside, clamping outside.

    Example:
        >>> fitted_range(torch.tensor([5.0, 0.0, 0.0, 5.0]), 0.0, 4.0)  # values at both ends: nothing to clamp
        (0.0, 4.0)
    """
    low, high = min(float(low), 0.0), max(float(high), 0.0)
    if high <= low or histogram.sum() <= 0:
        return low, high
    counts = histogram.double()
    bins = counts.numel()
    edges = torch.linspace(low, high, bins + 1, dtype=torch.float64)
    centres = (edges[:-1] + edges[1:]) / 2
    # prefix sums of n, n*c, n*c^2 (index k: the bins before edge k)
    zero = torch.zeros(1, dtype=torch.float64)
    n = torch.cat([zero, counts.cumsum(0)])
    s1 = torch.cat([zero, (counts * centres).cumsum(0)])
    s2 = torch.cat([zero, (counts * centres * centres).cumsum(0)])
    total = n[-1]
    lower = torch.nonzero(edges <= 0).flatten().tolist()
    upper = torch.nonzero(edges >= 0).flatten().tolist()
    lower = sorted(set(lower[::max(1, len(lower) // CANDIDATES)] + [lower[-1]]))
    upper = sorted(set(upper[::max(1, len(upper) // CANDIDATES)] + [upper[-1]]))
    i, j = torch.tensor(lower), torch.tensor(upper)
    a = edges[i].clamp(max=0.0)  # (the last edge at or below 0 is taken as 0: zero padding stays exact)
    b = edges[j].clamp(min=0.0)
    if edges[lower[-1]] < 0 < edges[upper[0]]:  # 0 falls inside a bin: a range may end exactly there
        a[-1], b[0] = 0.0, 0.0
    # the values below a (bins before edge i) are clamped up to a; those above b (bins from edge j on) down to b
    below = s2[i] - 2 * a * s1[i] + a * a * n[i]
    above = (s2[-1] - s2[j]) - 2 * b * (s1[-1] - s1[j]) + b * b * (total - n[j])
    inside = total - n[i][:, None] - (total - n[j])[None, :]
    step = (b[None, :] - a[:, None]) / 255
    error = below[:, None] + above[None, :] + inside.clamp(min=0) * step * step / 12
    error = torch.where(step > 0, error, torch.full_like(error, float("inf")))
    best = int(error.argmin())
    return float(a[best // len(upper)]), float(b[best % len(upper)])


class _Extremes(torch.fx.Interpreter):
    """Runs the graph and widens each named layer's recorded input range by the finite values it is given."""

    def __init__(self, gm: torch.fx.GraphModule, names: set[str], ranges: dict[str, tuple[float, float]]):
        super().__init__(gm)
        self.names, self.ranges = names, ranges

    def run_node(self, n: Node) -> Any:
        if n.name in self.names:
            x = self.env[_argument(n, 0, "input", None)]
            finite = x[torch.isfinite(x)]
            if finite.numel():
                low, high = self.ranges.get(n.name, (0.0, 0.0))
                self.ranges[n.name] = (min(low, finite.min().item()), max(high, finite.max().item()))
        return super().run_node(n)


class _Histograms(torch.fx.Interpreter):
    """Runs the graph and counts each named layer's input values into BINS bins over its observed range."""

    def __init__(self, gm: torch.fx.GraphModule, ranges: dict[str, tuple[float, float]],
                 counts: dict[str, torch.Tensor]):
        super().__init__(gm)
        self.ranges, self.counts = ranges, counts

    def run_node(self, n: Node) -> Any:
        if n.name in self.ranges:
            x = self.env[_argument(n, 0, "input", None)].detach()
            low, high = self.ranges[n.name]
            if high > low:
                counts = torch.histc(x.float().flatten(), BINS, low, high)  # (NaN and infinities fall outside)
                self.counts[n.name] = self.counts.get(n.name, 0) + counts
        return super().run_node(n)


def fitted_ranges(gm: torch.fx.GraphModule, calls: Sequence[tuple], extremes: dict[str, tuple[float, float]]
                  ) -> dict[str, tuple[float, float]]:
    """Each named layer's range fitted (:func:`fitted_range`) to the values its input met on ``calls`` (run
    again), within its observed ``extremes`` (widened to hold 0).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))
        >>> fitted_ranges(gm, [(torch.tensor([[-1.0, 3.0]]),)], {"_1": (0.0, 3.0)})
        {'_1': (0.0, 3.0)}
    """
    bounds = {name: (min(low, 0.0), max(high, 0.0)) for name, (low, high) in extremes.items()}
    counts: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for args in calls:
            _Histograms(gm, bounds, counts).run(*args)
    return {name: fitted_range(counts[name], *bounds[name]) if name in counts else bounds[name]
            for name in extremes}


def observe_inputs(gm: torch.fx.GraphModule, calls: Sequence[tuple], names: Sequence[str], *, fit: bool = True
                   ) -> dict[str, tuple[float, float]]:
    """The range each named layer of ``gm`` quantizes its input in, from the values met on ``calls`` (each a tuple
    of arguments), holding 0: fitted to them (:func:`fitted_ranges`; the graph runs twice), or with ``fit=False``
    their extremes. A layer that met no finite value has no range.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))
        >>> observe_inputs(gm, [(torch.tensor([[-1.0, 3.0]]),)], ["_1"])
        {'_1': (0.0, 3.0)}
    """
    extremes: dict[str, tuple[float, float]] = {}
    with torch.no_grad():
        for args in calls:
            _Extremes(gm, set(names), extremes).run(*args)
    return fitted_ranges(gm, calls, extremes) if fit else extremes
