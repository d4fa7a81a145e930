"""ONNX export of models whose weights have more than one name or more than one reader (issue 48 item 3).

Tied weights (nanoGPT's ``wte.weight = lm_head.weight``), a module used twice (siamese), one buffer registered
under two modules, and a parameter read both as a layer's weight and in a matmul: each exports through
``fxforge.export_onnx``, the CLI (``fxforge export``, ``fxforge optimize -o x.onnx``) and the ``onnxruntime``
target, and ONNX Runtime gives eager's outputs on fresh inputs (a new batch and length where the file is dynamic).
Before the fix, every one of these paths failed with ``KeyError: "attribute '_fxforge_constant_0' already
exists"``: the second name of a tied weight was taken for a constant and registered again as a buffer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from fxforge.core.verify import compare_outputs
from fxforge.exporters import OnnxRuntimeModule
from fxforge.exporters.program import exportable

sys.path.insert(0, str(Path(__file__).parents[1] / "user_models"))
from hand_written import USER_MODELS

TOLERANCE = 10.0  # rtol_scale, as export_onnx validates


def assert_runs_like(model: nn.Module, run, *inputs) -> float:
    """``run(*inputs)`` (an ONNX Runtime module) gives ``model``'s outputs; returns the max abs error."""
    with torch.no_grad():
        expected = model(*inputs)
        actual = run(*inputs)
    result = compare_outputs(expected, actual, rtol_scale=TOLERANCE)
    assert result.ok, result.reason
    return result.max_abs_err


class SharedBuffer(nn.Module):
    """One buffer tensor registered under two modules (a shared position table / scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        scale = torch.linspace(0.5, 1.5, 8)
        self.a.register_buffer("scale", scale)
        self.b.register_buffer("scale", scale)

    def forward(self, x):
        return self.b(self.a(x) * self.a.scale) + self.b.scale


class WeightAndMatmul(nn.Module):
    """A parameter read as a Linear's weight and again in a matmul (an output projection back to the input)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)

    def forward(self, x):
        return torch.tanh(self.norm(self.proj(x))) @ self.proj.weight


class TiedThrice(nn.Module):
    """One parameter under three names (encoder, decoder, and a plain attribute), read by F.linear and F.embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.extra = self.embed.weight

    def forward(self, ids):
        h = self.body(self.embed(ids))
        return self.head(h) + F.linear(h, self.extra).softmax(-1)


def test_tied_names_stay_parameters_in_the_exported_graph():
    """The second name of a tied weight is a parameter, not a constant made into a new buffer."""
    gm = torch.fx.symbolic_trace(TiedThrice().eval())
    copy, _ = exportable(gm)
    assert not [name for name, _ in copy.named_buffers() if name.startswith("_fxforge_constant")]


@pytest.mark.parametrize("method", ["export", "fx"])
def test_gpt_with_tied_weights_exports_and_serves_new_shapes(method, tmp_path):
    case = USER_MODELS["gpt"]()
    result = fxforge.export_onnx(case.model, tmp_path / "g.onnx", case.inputs, dynamic_batch=True, method=method)
    assert result.dynamic and max(result.validation.values()) < 1e-3
    run = OnnxRuntimeModule(str(tmp_path / "g.onnx"))
    for batch in (3, 1):  # new batch sizes, new tokens
        assert_runs_like(case.model, run, torch.randint(0, 96, (batch, 16)))
    weights = [i for i in onnx.load(str(tmp_path / "g.onnx")).graph.initializer if list(i.dims) == [96, 32]]
    assert len(weights) == 1  # the tied weight is stored once


@pytest.mark.parametrize("factory", [SharedBuffer, WeightAndMatmul, TiedThrice])
def test_aliased_weights_export(factory, tmp_path):
    torch.manual_seed(0)
    model = factory().eval()
    inputs = (torch.randint(0, 50, (2, 7)),) if factory is TiedThrice else (torch.randn(3, 8 if factory is SharedBuffer else 16),)
    fresh = (torch.randint(0, 50, (5, 7)),) if factory is TiedThrice else (torch.randn(6, inputs[0].shape[1]),)
    fxforge.export_onnx(model, tmp_path / "m.onnx", inputs, dynamic_batch=True)
    assert_runs_like(model, OnnxRuntimeModule(str(tmp_path / "m.onnx")), *fresh)


def test_siamese_module_used_twice(tmp_path):
    case = USER_MODELS["siamese"]()
    fxforge.export_onnx(case.model, tmp_path / "s.onnx", case.inputs, dynamic_batch=True)
    run = OnnxRuntimeModule(str(tmp_path / "s.onnx"))
    for fresh in case.fresh:
        assert_runs_like(case.model, run, *fresh)


def test_onnxruntime_target_serves_tied_weights():
    case = USER_MODELS["gpt"]()
    opt = fxforge.optimize(case.model, case.inputs, target="onnxruntime")
    for _ in range(2):  # new tokens (new lengths re-export with the seq dim dynamic: not this test's business)
        assert_runs_like(case.model, opt, torch.randint(0, 96, (1, 16)))


@pytest.mark.parametrize("command", ["export", "optimize"])
def test_cli_exports_tied_weights(command, tmp_path, monkeypatch):
    from fxforge.cli import main

    monkeypatch.chdir(tmp_path)
    folder = Path(__file__).parents[1] / "user_models"
    (tmp_path / "tied.py").write_text(f"import sys\nsys.path.insert(0, {str(folder)!r})\n"
                                      "from hand_written import gpt\n\n\ndef model():\n    return gpt().model\n")
    code = main([command, f"{tmp_path / 'tied.py'}:model", "--input", "1x16:int64", "-o", "gpt.onnx"])
    assert code == 0 and (tmp_path / "gpt.onnx").exists()
    case = USER_MODELS["gpt"]()
    run = OnnxRuntimeModule(str(tmp_path / "gpt.onnx"))
    assert_runs_like(case.model, run, torch.randint(0, 96, (1, 16)))
