"""cleanup: each no-op rule fires on every call form it claims, refuses what it must, keeps effects."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge


def _rewrite(model, inputs, method):
    cap = fxforge.capture(model, inputs, method=method)
    new = fxforge.rewrite(cap, ["cleanup"])
    return cap, new


def _whats(report):
    return sorted({m.what for m in report.matches})


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


class DropoutForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        x = self.drop(self.lin(x))
        x = F.dropout(x, 0.2, training=self.training)
        return torch.dropout(x, 0.1, self.training).relu()


@pytest.mark.parametrize("method", ["fx", "export"])
def test_dropout_in_eval_is_removed_in_every_form(method):
    model = DropoutForms().eval()
    x = torch.randn(3, 6)
    _cap, new = _rewrite(model, (x,), method)
    dropouts = [m for m in new.report.matches if m.what == "dropout in eval removed"]
    # export already drops F.dropout(training=False) itself; fx keeps all three calls
    assert len(dropouts) == (3 if method == "fx" else len(dropouts)) and dropouts
    assert not any("dropout" in str(t) for t in _targets(new.graph_module))
    torch.testing.assert_close(new.graph_module(x), model(x), rtol=0, atol=0)
    assert all(m.source and "test_cleanup.py" in m.source for m in dropouts)


def test_dropout_in_training_is_kept_with_a_reason():
    model = DropoutForms().train()
    x = torch.randn(3, 6)
    _cap, new = _rewrite(model, (x,), "fx")
    assert "dropout in eval removed" not in _whats(new.report)
    reasons = [n.reason for n in new.report.near_misses]
    assert "dropout (p=0.3) is active in training mode" in reasons
    assert len(reasons) == 3


class NoOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.ident = nn.Identity()

    def forward(self, x):
        y = self.ident(x).contiguous()           # contiguous of contiguous
        y = y.to(torch.float32).float()          # same dtype twice
        y = y.view(y.shape).reshape(4, 5)        # same shape twice
        z = y.transpose(0, 1).contiguous()       # NOT a no-op: transposed is not contiguous
        w = y.to(torch.float64)                  # NOT a no-op: dtype changes
        return z.sum() + w.sum().float() + y


@pytest.mark.parametrize("method", ["fx", "export"])
def test_no_ops_removed_real_conversions_kept(method):
    model = NoOps()
    x = torch.randn(4, 5)
    _cap, new = _rewrite(model, (x,), method)
    whats = _whats(new.report)
    assert "reshape to the same shape removed" in whats
    assert "conversion to the same dtype/device removed" in whats
    if method == "export":  # export records neither identity modules nor contiguous() of contiguous
        assert "dtype/device assertion proven by the shapes removed" in whats
        assert not any("assert" in str(t) for t in _targets(new.graph_module))
    if method == "fx":
        assert "identity removed" in whats
        assert "contiguous() of a contiguous value removed" in whats
        assert new.report.counts["cleanup"] == 7  # the six no-ops and the dead y.shape lookup
        assert _targets(new.graph_module).count("contiguous") == 1
        assert "transpose" in _targets(new.graph_module)
    torch.testing.assert_close(new.graph_module(x), model(x), rtol=0, atol=0)


class DeadCode(nn.Module):
    def forward(self, x):
        x * 2                  # dead: removed
        kept = torch.zeros_like(x)
        kept.add_(1)                    # in-place on a value used later: kept
        _ = torch.rand_like(x)          # random: kept (would shift the RNG stream)
        return x + kept


def test_dead_code_removed_but_effects_kept():
    model = DeadCode()
    x = torch.randn(3)
    _cap, new = _rewrite(model, (x,), "fx")
    removed = [m for m in new.report.matches if m.what == "dead code removed"]
    assert [m.nodes for m in removed] == [["mul"]]
    targets = _targets(new.graph_module)
    assert "add_" in targets and torch.rand_like in targets
    torch.manual_seed(0)
    a = new.graph_module(x)
    torch.manual_seed(0)
    torch.testing.assert_close(a, model(x))


def test_export_buffer_mutation_in_training_is_kept():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    x = torch.randn(2, 3, 8, 8)
    _cap, new = _rewrite(model, (x,), "export")
    targets = [str(t) for t in _targets(new.graph_module)]
    assert "aten.add_.Tensor" in targets  # num_batches_tracked += 1 survives dead-code elimination


def test_cleanup_leaves_the_model_and_the_input_capture_alone():
    model = DropoutForms().eval()
    x = torch.randn(3, 6)
    cap = fxforge.capture(model, (x,))
    before = [n.name for n in cap.graph_module.graph.nodes]
    params = {k: v.clone() for k, v in model.state_dict().items()}
    fxforge.rewrite(cap)
    assert [n.name for n in cap.graph_module.graph.nodes] == before
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
