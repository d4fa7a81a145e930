"""``cleanup`` computes once what a graph computes from constants alone (issue 50: BEiT ran slower than eager
because its captured graph rebuilt, on every call, the relative-position index eager caches)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxforge


class RelativeBias(nn.Module):
    """A relative-position bias as BEiT builds it: an index from arange/meshgrid, written into zeros by slices,
    then a gather from a learned table."""

    def __init__(self, window: int = 4, heads: int = 2):
        super().__init__()
        self.window = window
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2 + 1, heads))

    def index(self) -> torch.Tensor:
        coords = torch.stack(torch.meshgrid(torch.arange(self.window), torch.arange(self.window), indexing="ij"))
        flat = coords.flatten(1)
        relative = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0).contiguous()
        relative[:, :, 0] += self.window - 1
        relative[:, :, 1] += self.window - 1
        relative[:, :, 0] *= 2 * self.window - 1
        area = self.window * self.window
        index = torch.zeros(area + 1, area + 1, dtype=relative.dtype)
        index[1:, 1:] = relative.sum(-1)
        index[0, :] = torch.tensor((2 * self.window - 1) ** 2)
        return index

    def forward(self, x):
        bias = self.table[self.index().view(-1)].view(x.shape[-1], x.shape[-1], -1).permute(2, 0, 1)
        return x + bias


@pytest.mark.parametrize("method", ["export", "dynamo"])
def test_an_index_built_from_constants_is_computed_once(method):
    model, x = RelativeBias().eval(), torch.randn(3, 2, 17, 17)
    if method == "dynamo":
        opt = fxforge.optimize(model, (x,), method="dynamo")
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
        return
    new = fxforge.rewrite(fxforge.capture(model, (x,), method=method), ["cleanup"])
    whats = [m.what for m in new.report.matches]
    assert any(w.startswith("constant computation") for w in whats), whats
    targets = [str(n.target) for n in new.graph_module.graph.nodes]
    assert not any("arange" in t or "copy_" in t or "fill_" in t for t in targets), targets
    for fresh in (x, torch.randn(3, 2, 17, 17)):
        torch.testing.assert_close(new.graph_module(fresh), model(fresh))
    with torch.no_grad():  # the table still comes from the live parameter
        model.table.mul_(-1)
    torch.testing.assert_close(new.graph_module(x), model(x))


def test_a_constant_the_graph_writes_into_from_its_inputs_is_built_on_every_call():
    class Masked(nn.Module):
        def forward(self, x):
            keep = torch.ones(x.shape[-1]).cumsum(0)  # constant, then written into from the input
            keep.masked_fill_(x[0] > 0, 0.0)
            return x * keep

    model = Masked().eval()
    x = torch.randn(2, 5)
    new = fxforge.rewrite(fxforge.capture(model, (x,), method="export"), ["cleanup"])
    for _ in range(2):
        fresh = torch.randn(2, 5)
        torch.testing.assert_close(new.graph_module(fresh), model(fresh))
