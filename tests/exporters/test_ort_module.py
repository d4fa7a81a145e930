"""``fxforge.optimize(..., target="onnxruntime")`` and ``OnnxRuntimeModule``: called like the model, outputs in
the model's own structure, session options exposed, clear errors for inputs the file does not take."""

from __future__ import annotations

import gc
import os

import onnxruntime as ort
import pytest
import torch
from torch import nn

import fxforge
from fxforge.core.verify import compare_outputs
from fxforge.exporters import InputShapeError, OnnxRuntimeModule


def assert_same(expected, actual):
    result = compare_outputs(expected, actual, rtol_scale=10.0)
    assert result.ok, result.reason


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


class Structured(nn.Module):
    """Keyword inputs, an optional one, and nested outputs with Python values among them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x, extra=None, scale: float = 2.0):
        out = {"a": self.a(x) * scale, "pair": (self.b(x), torch.tanh(x)), "none": None, "n": 3}
        if extra is not None:
            out["extra"] = extra + 1
        return out


def test_optimize_onnxruntime_is_a_module(tmp_path):
    torch.manual_seed(0)
    model = ConvNet().eval()
    x = torch.randn(2, 3, 8, 8)
    opt = fxforge.optimize(model, (x,), target="onnxruntime")
    assert isinstance(opt, nn.Module) and isinstance(opt, OnnxRuntimeModule)
    assert opt.report.counts == {"conv_bn_fold": 1, "conv_activation": 1}
    assert any(n.startswith("onnx: validated in ONNX Runtime") for n in opt.report.notes)
    assert opt.providers == ["CPUExecutionProvider"] and opt.device == torch.device("cpu")
    assert opt.intra_op_num_threads == torch.get_num_threads()
    assert opt.session_options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    fresh = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert_same(model(fresh), opt(fresh))
    assert list(opt.state_dict()) == []  # the ONNX file holds the weights


def test_thread_count_and_options_recreate_the_session():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU()).eval()
    x = torch.randn(3, 4)
    opt = fxforge.optimize(model, (x,), target="onnxruntime", intra_op_num_threads=1)
    assert opt.intra_op_num_threads == 1
    first = opt.session
    opt.intra_op_num_threads = 2
    assert opt.intra_op_num_threads == 2 and opt.session is not first
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    opt.session_options = options
    assert opt.session_options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with torch.no_grad():
        assert_same(model(x), opt(x))


def test_session_options_and_providers_at_creation():
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    opt = fxforge.optimize(nn.ReLU().eval(), (torch.randn(2),), target="onnxruntime", session_options=options,
                           providers=["CPUExecutionProvider"])
    assert opt.intra_op_num_threads == 1 and opt.providers == ["CPUExecutionProvider"]


def test_a_cuda_model_is_refused_where_onnxruntime_has_no_cuda_provider(monkeypatch):
    from fxforge.exporters.ort_session import ort_refusal

    assert ort_refusal(torch.device("cpu")) is None
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert "no CUDAExecutionProvider" in ort_refusal(torch.device("cuda"))
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert ort_refusal(torch.device("cuda")) is None


def test_outputs_in_the_models_structure():
    torch.manual_seed(0)
    model = Structured().eval()
    x, extra = torch.randn(2, 4), torch.randn(2, 2)
    opt = fxforge.optimize(model, {"x": x, "extra": extra}, target="onnxruntime")
    out = opt(extra=extra * 3, x=x)  # keywords in another order
    with torch.no_grad():
        expected = model(x, extra=extra * 3)
    assert type(out) is dict and list(out) == list(expected)
    assert out["none"] is None and out["n"] == 3 and isinstance(out["pair"], tuple)
    assert_same(expected, out)


@pytest.mark.parametrize("wrap", [lambda a, b: {"a": a, "b": b}, lambda a, b: [a, {"b": b}]], ids=["dict", "list"])
def test_outputs_of_tensors_only_keep_the_models_dicts_and_lists(wrap):
    """A traced graph returns fx's immutable dict and list: the module returns what the model returned."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return wrap(self.lin(x), x.tanh())

    model = Net().eval()
    opt = fxforge.optimize(model, (torch.randn(2, 4),), target="onnxruntime")
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
    out = opt(x)
    assert_same(expected, out)
    assert type(out) is type(expected)


def test_calls_it_was_not_exported_for():
    model = Structured().eval()
    static = fxforge.optimize(model, {"x": torch.randn(2, 4), "scale": 2.0}, target="onnxruntime", dynamic=False)
    assert_same(model(torch.ones(2, 4), scale=2.0), static(x=torch.ones(2, 4), scale=2.0))
    with pytest.raises(InputShapeError, match="differ from the exported ones"):
        static(x=torch.randn(2, 4), extra=torch.randn(2, 2), scale=2.0)
    with pytest.raises(InputShapeError, match="keyword inputs"):
        static(torch.randn(2, 4))  # positional, exported as a keyword, without the keyword it was exported with
    # positional where it was exported as a keyword: bound to its name by the forward's signature
    assert_same(model(torch.ones(2, 4), scale=2.0), static(torch.ones(2, 4), scale=2.0))
    with pytest.raises(InputShapeError, match="fixed to 2.0 at export; this call passes 3.0"):
        static(x=torch.randn(2, 4), scale=3.0)
    positional = fxforge.optimize(model, (torch.randn(2, 4),), target="onnxruntime", dynamic=False)
    with pytest.raises(InputShapeError, match="differ from the exported ones"):
        positional(torch.randn(2, 4), torch.randn(2, 2))  # 'extra', not exported


def test_calls_of_another_structure_get_an_export_of_their_own():
    """dynamic=None (the default): an optional input added or left out exports the model for that call structure
    once, as native plans per structure; later calls of each structure reuse theirs. Another fixed value is
    refused, naming it."""
    model = Structured().eval()
    opt = fxforge.optimize(model, {"x": torch.randn(2, 4), "scale": 2.0}, target="onnxruntime")
    x, extra = torch.randn(2, 4), torch.randn(2, 2)
    assert_same(model(x, extra=extra, scale=2.0), opt(x=x, extra=extra, scale=2.0))
    assert_same(model(x), opt(x))
    assert opt.exports == 3
    assert_same(model(x * 2, extra=extra, scale=2.0), opt(x=x * 2, extra=extra, scale=2.0))
    assert opt.exports == 3
    with pytest.raises(InputShapeError, match="fixed to 2.0 at export; this call passes 3.0"):
        opt(x=x, scale=3.0)


class Tagger(nn.Module):
    """Token ids in, tags out: eager takes int32 ids as well as int64 ones."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.embed(ids).relu())


def test_inputs_of_other_dtypes_get_an_export_of_their_own():
    """dynamic=None: token ids of another integer dtype than the exported one are served by an export of their
    own (as a native plan per dtype), not refused; with a fixed file they are refused, naming the dtype."""
    torch.manual_seed(0)
    model = Tagger().eval()
    ids = torch.randint(0, 20, (2, 5))
    opt = fxforge.optimize(model, (ids,), target="onnxruntime")
    assert_same(model(ids), opt(ids))
    narrow = torch.randint(0, 20, (3, 7), dtype=torch.int32)
    assert_same(model(narrow), opt(narrow))
    assert opt.exports == 2
    assert_same(model(narrow[:, :4]), opt(narrow[:, :4]))  # the int32 file keeps its own sizes growing
    assert_same(model(ids), opt(ids))
    static = fxforge.optimize(model, (ids,), target="onnxruntime", dynamic=False)
    with pytest.raises(InputShapeError, match="has dtype torch.int32; the ONNX model takes torch.int64"):
        static(narrow[:2, :5])


def test_positional_tensors_take_the_short_way_and_anything_else_the_checked_one():
    from fxforge.exporters.io_spec import IOSpec

    spec = IOSpec.for_tensors(["a", "b"], 1)
    a, b = torch.ones(1), torch.zeros(1)
    assert spec._positional_names == ("a", "b")
    assert spec.feeds((a, b), {}) == [("a", a), ("b", b)]
    with pytest.raises(InputShapeError, match="structure"):
        spec.feeds((a,), {})  # one tensor short
    with pytest.raises(InputShapeError, match="must be a tensor"):
        spec.feeds((a, 2.0), {})
    with pytest.raises(InputShapeError, match="keyword inputs"):
        spec.feeds((a,), {"b": b})
    keywords = Structured().eval()
    opt = fxforge.optimize(keywords, {"x": torch.randn(2, 4), "scale": 2.0}, target="onnxruntime")
    assert opt.io._positional_names is None  # a keyword and a fixed value: every call checked in full


def test_shapes_the_file_does_not_take():
    model = nn.Linear(4, 3).eval()
    opt = fxforge.optimize(model, (torch.randn(2, 4),), target="onnxruntime", dynamic=False)
    with pytest.raises(InputShapeError, match=r"has shape \(5, 4\); the ONNX model takes \(2, 4\).*dynamic_batch"):
        opt(torch.randn(5, 4))
    with pytest.raises(InputShapeError, match="dtype torch.float64"):
        opt(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(InputShapeError, match="3 dims"):
        opt(torch.randn(1, 2, 4))


def test_dynamic_batch_takes_other_batches_but_one_batch():
    class Two(nn.Module):
        def forward(self, a, b):
            return a + b

    opt = fxforge.optimize(Two().eval(), (torch.randn(2, 3), torch.randn(2, 3)), target="onnxruntime",
                           dynamic_batch=True)
    a, b = torch.randn(7, 3), torch.randn(7, 3)
    assert torch.allclose(opt(a, b), a + b)
    with pytest.raises(InputShapeError, match="needs them equal"):
        opt(torch.randn(4, 3), torch.randn(5, 3))


def test_exports_on_first_call_without_example_inputs():
    model = ConvNet().eval()
    opt = fxforge.optimize(model, target="onnxruntime")
    assert opt.report is None and "not exported yet" in repr(opt)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert_same(model(x), opt(x))
    assert opt.report.counts["conv_bn_fold"] == 1 and os.path.exists(opt.path)


def test_decorated_class():
    @fxforge.optimize(target="onnxruntime", intra_op_num_threads=1)
    class Net(nn.Module):
        """A net."""

        def __init__(self):
            super().__init__()
            self.fc, self.drop = nn.Linear(4, 4), nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(torch.relu(self.fc(x)))

    net = Net()
    assert Net.__name__ == "Net" and Net.__doc__ == "A net."
    x = torch.randn(3, 4)
    net(x).sum().backward()  # training mode: the module's own forward, with gradients
    assert net.fxforge_onnxruntime is None and net.fc.weight.grad is not None
    net.eval()
    with torch.no_grad():
        expected = torch.relu(net.fc(x))
    assert_same(expected, net(x))
    assert isinstance(net.fxforge_onnxruntime, OnnxRuntimeModule) and net.report.counts["cleanup"] == 1
    assert net.fxforge_onnxruntime.intra_op_num_threads == 1


def test_options_checked():
    with pytest.raises(TypeError, match="does not take threads"):
        fxforge.optimize(nn.ReLU(), target="onnxruntime", threads=2)
    with pytest.raises(TypeError, match="target 'native' does not take intra_op_num_threads"):
        fxforge.optimize(nn.ReLU(), target="native", intra_op_num_threads=2)


def test_temporary_file_removed_with_the_module(tmp_path):
    opt = fxforge.optimize(nn.ReLU().eval(), (torch.randn(2),), target="onnxruntime")
    folder = os.path.dirname(opt.path)
    assert os.path.isdir(folder)
    del opt
    gc.collect()
    assert not os.path.exists(folder)
    kept = fxforge.optimize(nn.ReLU().eval(), (torch.randn(2),), target="onnxruntime", path=tmp_path / "relu.onnx")
    assert kept.path == str(tmp_path / "relu.onnx") and os.listdir(tmp_path) == ["relu.onnx"]


def test_module_from_a_file(tmp_path):
    path = str(tmp_path / "m.onnx")
    fxforge.export_onnx(ConvNet().eval(), path, (torch.randn(2, 3, 8, 8),))
    module = OnnxRuntimeModule(path, intra_op_num_threads=1)
    assert module(torch.randn(2, 3, 8, 8)).shape == (2, 5)
    assert module.intra_op_num_threads == 1 and "m.onnx" in repr(module)


def test_no_provider_messages_on_cpu(capfd):
    fxforge.optimize(nn.ReLU().eval(), (torch.randn(2),), target="onnxruntime")(torch.randn(2))
    out, err = capfd.readouterr()
    assert "Failed to load" not in err + out and "CUDA" not in err + out


@pytest.mark.slow
def test_transformers_model_output():
    from models import TRANSFORMERS  # tests/corpus, put on the path by conftest.py

    model, inputs = TRANSFORMERS["bert"]()
    opt = fxforge.optimize(model, inputs, target="onnxruntime", dynamic_batch=True)
    out = opt(**inputs)
    assert type(out).__name__ == "BaseModelOutputWithPoolingAndCrossAttentions"
    with torch.no_grad():
        assert_same(model(**inputs), out)
    assert "attention -> com.microsoft.MultiHeadAttention: 2" in opt.onnx_export.translations


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime's CUDAExecutionProvider (onnxruntime-gpu)")
def test_cuda_io_binding():
    model = ConvNet().eval().cuda()
    x = torch.randn(2, 3, 8, 8, device="cuda")
    opt = fxforge.optimize(model, (x,), target="onnxruntime", dynamic_batch=True)
    assert opt.providers[0] == "CUDAExecutionProvider" and opt.device.type == "cuda"
    out = opt(torch.randn(4, 3, 8, 8, device="cuda"))
    assert out.device.type == "cuda" and out.shape == (4, 5)
    with torch.no_grad():
        assert_same(model(x), opt(x))
