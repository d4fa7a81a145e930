"""Native artifacts: the rewritten graph saved with torch.export keeps fxforge's fused ops, loads back as a
module (also in a fresh interpreter) and computes what the OptimizedModule computes; failures leave nothing."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import fxforge
from fxforge.exporters import ExportError
from fxforge.exporters.pt2 import fused_op_counts, load, save_native
from fxforge.lowering.autotune import TuningPolicy
from fxforge.lowering.kernels import mkldnn_available


class ConvHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return torch.relu(self.fc(x.mean((2, 3))))


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return {"y": self.lin(x), "scale": 2, "nothing": None}


@pytest.mark.parametrize("kernel, layout", [("mkldnn", "channels-last"), ("composite", "as captured")])
def test_fused_ops_survive_and_match_the_optimized_module(tmp_path, kernel, layout):
    if kernel == "mkldnn" and not mkldnn_available():
        pytest.skip("no oneDNN in this torch build")
    torch.manual_seed(0)
    model = ConvHead().eval()
    x = torch.randn(2, 3, 16, 16)
    opt = fxforge.optimize(model, (x,), tuning=TuningPolicy(kernel=kernel, layout=layout, keep="fused"))
    assert opt.report.counts["conv_activation"] == 2
    saved = save_native(opt.captured, tmp_path / "m.pt2", dynamic_batch=True)
    assert saved.ops == {"fxforge::conv_pointwise": 1, "fxforge::linear_pointwise": 1}
    assert sorted(saved.validation) == ["batch 3", "example inputs"]
    loaded = load(tmp_path / "m.pt2")
    assert fused_op_counts(loaded.graph) == saved.ops
    for batch in (2, 5):
        y = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(loaded(y), opt(y), rtol=1e-5, atol=1e-5)
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt2"]


def test_load_in_a_fresh_interpreter(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    captured = fxforge.rewrite(fxforge.capture(model, (torch.ones(2, 4),)),
                               tuning=TuningPolicy(kernel="composite", keep="fused"))
    save_native(captured, tmp_path / "m.pt2")
    code = ("import torch, fxforge; m = fxforge.load(r'%s'); "
            "print(isinstance(m, torch.nn.Module), m(torch.ones(2, 4)).shape)" % (tmp_path / "m.pt2"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True torch.Size([2, 4])"


def test_the_output_structure_comes_back(tmp_path):
    model = Structured().eval()
    x = torch.randn(3, 4)
    saved = save_native(fxforge.capture(model, (x,)), tmp_path / "s.pt2")
    out = load(saved.path)(x)
    assert out.keys() == {"y", "scale", "nothing"} and out["scale"] == 2 and out["nothing"] is None
    torch.testing.assert_close(out["y"], model(x)["y"])


def test_a_failed_save_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "m.pt2"
    target.write_bytes(b"old")

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch.export, "save", broken_save)
    with pytest.raises(ExportError, match="writing the .pt2 file failed: OSError: disk full"):
        save_native(fxforge.capture(nn.Linear(2, 2).eval(), (torch.ones(1, 2),)), target)
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt2"] and target.read_bytes() == b"old"


def test_training_mode_and_missing_folder_are_refused(tmp_path):
    with pytest.raises(ExportError, match="training mode"):
        save_native(fxforge.capture(nn.Linear(2, 2).train(), (torch.ones(1, 2),)), tmp_path / "m.pt2")
    with pytest.raises(FileNotFoundError, match="no folder"):
        save_native(fxforge.capture(nn.Linear(2, 2).eval(), (torch.ones(1, 2),)), tmp_path / "no" / "m.pt2")
    assert list(tmp_path.iterdir()) == []


class KeywordsAndDict(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        x = input_ids.float() * attention_mask
        return {"sum": x.sum(-1), "parts": [x, x * 2]}


def test_a_loaded_program_takes_its_inputs_by_name_and_returns_plain_dicts_and_lists(tmp_path):
    model = KeywordsAndDict().eval()
    ids, mask = torch.arange(6).view(2, 3), torch.ones(2, 3)
    path = tmp_path / "kw.pt2"
    save_native(fxforge.capture(model, (ids, mask)), path)
    loaded = fxforge.load(path)
    for out in (loaded(ids, mask), loaded(ids, attention_mask=mask), loaded(input_ids=ids, attention_mask=mask)):
        assert type(out) is dict and type(out["parts"]) is list
        assert torch.equal(out["sum"], model(ids, mask)["sum"])
