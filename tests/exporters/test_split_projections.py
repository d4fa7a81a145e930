"""A projection read in blocks, some of them on a few rows only: one product per such block, same values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from ir_graphs import onnx_applied, op_counts, run_graph
from onnxscript import ir
from test_onnx import assert_runs_like
from torch import nn

from fxforge import export_onnx
from fxforge.exporters.split_projections import SPLIT_PROJECTIONS, _packed_projection_graph, split_projections


def _run(graph: ir.Graph, x: np.ndarray) -> list[np.ndarray]:
    return run_graph(graph, {"x": x})


@pytest.mark.parametrize("slices, split, products", [
    # q on token 0, k and v on every token: q alone, k and v from one [8, 16] product
    ([((0, 1), (0, 8)), ((0, 5), (8, 16)), ((0, 5), (16, 24))], 1, 2),
    # two blocks of one row each, the columns between them unread
    ([((2, 3), (0, 4)), ((0, 1), (20, 24))], 2, 2),
])
def test_blocks_that_read_some_rows_get_their_own_product(slices, split, products):
    graph = _packed_projection_graph(tokens=5, width=8, slices=slices)
    x = np.random.default_rng(1).standard_normal([1, 5, 8]).astype(np.float32)
    x[0, 4, 3] = np.nan  # a NaN in a row only k and v read
    expected = _run(graph, x)
    assert split_projections(graph) == split
    assert op_counts(graph)["MatMul"] == products
    for got, want in zip(_run(graph, x), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("slices", [
    [((0, 5), (0, 8)), ((0, 5), (8, 24))],  # every row read: one product and its slices stay
    [((0, 1), (0, 12)), ((0, 5), (8, 24))],  # overlapping columns: the weights would be stored twice
])
def test_other_readings_are_left(slices):
    graph = _packed_projection_graph(tokens=5, width=8, slices=slices)
    assert split_projections(graph) == 0
    assert op_counts(graph)["MatMul"] == 1


def test_a_product_read_whole_somewhere_is_left():
    graph = _packed_projection_graph(tokens=5, width=8, slices=[((0, 1), (0, 8))])
    product = next(node for node in graph if node.op_type == "Add").outputs[0]
    relu = ir.Node("", "Relu", [product], outputs=[ir.Value(name="whole", type=product.type, shape=product.shape)])
    graph.append(relu)
    graph.outputs.append(relu.outputs[0])
    assert split_projections(graph) == 0


class ClassTokenEncoder(nn.Module):
    """A pre-norm block on ``nn.MultiheadAttention`` (torchvision's ViT form) or timm's packed ``qkv`` unpacking,
    classified from token 0: cleanup's dead rows cut the last block's query to one token."""

    def __init__(self, form: str, dim: int = 32, heads: int = 4, blocks: int = 2):
        super().__init__()
        self.form, self.heads = form, heads
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(blocks))
        if form == "torch":
            self.attentions = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(blocks))
        else:
            self.qkvs = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(blocks))
            self.projs = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        for i, norm in enumerate(self.norms):
            y = norm(x)
            if self.form == "torch":
                y = self.attentions[i](y, y, y, need_weights=False)[0]
            else:
                b, n, c = y.shape
                q, k, v = self.qkvs[i](y).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
                y = self.projs[i](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
            x = x + y
        return self.head(x[:, 0])


@pytest.mark.parametrize("form", ["torch", "timm"])
def test_the_last_query_is_projected_for_its_token_only(form, tmp_path):
    torch.manual_seed(0)
    model = ClassTokenEncoder(form).eval()
    path = str(tmp_path / "encoder.onnx")
    result = export_onnx(model, path, (torch.randn(1, 9, 32),))
    assert f"{SPLIT_PROJECTIONS}: 1" in onnx_applied(result.report), result.report
    graph = onnx.load(path).graph
    weights = {init.name: init.dims for init in graph.initializer}
    shapes = sorted(tuple(weights[n.input[1]]) for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights)
    assert (32, 32) in shapes and (32, 64) in shapes, shapes  # the last block's q, and its k and v together
    x = torch.randn(1, 9, 32)
    x[0, 5, 2] = float("nan")  # a NaN token: every query reads its key, as in eager
    assert_runs_like(model, path, x)
    assert_runs_like(model, path, torch.randn(1, 9, 32) * 20)
