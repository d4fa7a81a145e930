"""The ranges static int8 quantizes layer inputs in: fitted to the values met (``fxforge.lowering.int8_ranges``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxforge.lowering.int8_ops import input_qparams
from fxforge.lowering.int8_ranges import BINS, fitted_range, observe_inputs


def _error(values: torch.Tensor, low: float, high: float) -> float:
    """The mean squared error of ``values`` quantized to uint8 in ``[low, high]`` and back, as the plans do."""
    scale, zero = input_qparams(low, high)
    quantized = torch.fake_quantize_per_tensor_affine(values, scale, zero, 0, 255)
    return float((quantized - values).pow(2).mean())


def _fitted(values: torch.Tensor) -> tuple[float, float]:
    low, high = min(values.min().item(), 0.0), max(values.max().item(), 0.0)
    return fitted_range(torch.histc(values, BINS, low, high), low, high)


DISTRIBUTIONS = {
    "normal": lambda: torch.randn(200_000),
    "gelu of a normal": lambda: nn.functional.gelu(torch.randn(200_000) * 2),
    "heavy tailed": lambda: torch.distributions.StudentT(2.0).sample((200_000,)),
    "one outlier": lambda: torch.cat([torch.randn(200_000), torch.tensor([60.0])]),
    "relu of a skewed normal": lambda: torch.relu(torch.randn(200_000) + 1),
    "uniform": lambda: torch.rand(200_000) * 4 - 1,
}


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_the_fitted_range_rounds_and_clamps_less_than_the_extremes_and_near_the_best_on_a_grid(name):
    torch.manual_seed(0)
    values = DISTRIBUTIONS[name]()
    low, high = _fitted(values)
    extremes = (min(values.min().item(), 0.0), max(values.max().item(), 0.0))
    assert extremes[0] <= low <= 0.0 <= high <= extremes[1]
    fitted = _error(values, low, high)
    assert fitted <= _error(values, *extremes) * 1.01
    grid = torch.linspace(0.02, 1.0, 50)
    best = min(_error(values, extremes[0] * a, extremes[1] * b) for a in grid.tolist() for b in grid.tolist())
    assert fitted <= best * 1.05


def test_tails_are_clamped_and_ranges_without_tails_kept():
    torch.manual_seed(0)
    low, high = _fitted(torch.cat([torch.randn(1_000_000), torch.tensor([40.0])]))
    assert high < 20.0  # one 40 among a million normal values is clamped: the others' step is a third
    low, high = _fitted(torch.cat([torch.randn(1_000), torch.tensor([40.0])]))
    assert high == pytest.approx(40.0, abs=0.2)  # among a thousand, kept: clamping it would cost more
    uniform = DISTRIBUTIONS["uniform"]()
    low, high = _fitted(uniform)
    assert low == pytest.approx(uniform.min().item(), abs=0.05) and high == pytest.approx(uniform.max().item(),
                                                                                         abs=0.05)


def test_a_range_of_values_on_one_side_of_zero_starts_at_zero():
    low, high = _fitted(torch.rand(10_000) + 1)
    assert low == 0.0 and high > 1.9
    low, high = _fitted(-torch.rand(10_000) - 1)
    assert high == 0.0 and low < -1.9


def test_an_empty_histogram_keeps_the_extremes():
    assert fitted_range(torch.zeros(BINS), -1.0, 2.0) == (-1.0, 2.0)


class _Cubed(nn.Module):
    """A layer whose input is heavy tailed: the cube of a linear layer's output."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.down(self.up(x) ** 3)


def test_observed_ranges_fitted_on_the_graph_lie_within_the_extremes_and_quantize_the_input_closer():
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(_Cubed().eval())
    calls = [(torch.randn(256, 32),) for _ in range(3)]
    extremes = observe_inputs(gm, calls, ["up", "down"], fit=False)
    fitted = observe_inputs(gm, calls, ["up", "down"])
    with torch.no_grad():
        inputs = torch.cat([gm.up(x) ** 3 for (x,) in calls]).flatten()
    assert extremes["down"] == (inputs.min().item(), inputs.max().item())
    low, high = fitted["down"]
    assert extremes["down"][0] <= low and high <= extremes["down"][1]
    assert high - low < extremes["down"][1] - extremes["down"][0]  # some of the cube's tail is clamped
    assert _error(inputs, low, high) < _error(inputs, *extremes["down"])


def test_a_layer_that_met_only_nan_has_no_range():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4)))
    assert observe_inputs(gm, [(torch.full((2, 4), float("nan")),)], ["_0"]) == {}
