"""The public API: names, the decorator in both forms, argument errors."""

import pickle

import pytest
import torch
from torch import nn

import fxforge


@fxforge.optimize
class Block(nn.Module):
    """A user block."""

    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(torch.relu(self.lin(x)))


@fxforge.optimize(rewrites=[], verify=True)
class Plain(nn.Module):
    def forward(self, x):
        return x + 1


def test_public_names():
    for name in ("capture", "rewrite", "optimize", "Captured", "CaptureError", "Report", "OptimizedModule"):
        assert hasattr(fxforge, name)


def test_decorated_class_captures_lazily_and_across_shapes():
    block = Block().eval()
    assert isinstance(block, nn.Module) and type(block).__name__ == "Block"
    assert type(block).__doc__ == "A user block."
    assert block.report is None
    for batch in (2, 5):
        x = torch.randn(batch, 8)
        expected = block.lin(x).relu()
        torch.testing.assert_close(block(x), expected)
    assert block.report.counts == {"cleanup": 1}
    cache = block.__dict__["_fxforge_cache"]
    # batch 2 static, then batch 5 made the batch dynamic: one shape-generic plan serves both (2 retired)
    assert cache.plans_built == 2 and len(cache.plans) == 1 and cache.last.shapes is not None
    assert list(block.state_dict()) == ["lin.weight", "lin.bias"]


def test_decorator_with_options():
    plain = Plain()
    assert plain(torch.ones(2)).tolist() == [2.0, 2.0]
    assert plain.report.counts == {} and plain.report.method == "fx"


def test_decorated_instance_pickles_without_its_graphs():
    block = Block(4).eval()
    block(torch.randn(1, 4))
    clone = pickle.loads(pickle.dumps(block))
    x = torch.randn(3, 4)
    torch.testing.assert_close(clone(x), block(x))


def test_argument_errors_are_clear():
    with pytest.raises(ValueError, match="unknown target 'tpu'; available targets: native"):
        fxforge.optimize(nn.ReLU(), target="tpu")
    with pytest.raises(ValueError, match="unknown rewrite 'fold'"):
        fxforge.optimize(nn.ReLU(), rewrites=["fold"])
    with pytest.raises(TypeError, match="nn.Module instance or class"):
        fxforge.optimize(lambda x: x)
