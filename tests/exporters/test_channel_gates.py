"""Squeeze-and-excitation gates are written in the form ONNX Runtime's CPU provider keeps in its blocked
(NCHWc) layout, with the model's values, and torch's form stays where ORT could not keep the product blocked."""

from __future__ import annotations

import collections
import os
import platform

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_graphs import onnx_applied, onnx_refused
from onnxscript import ir
from test_onnx import assert_runs_like
from torch import nn
from torch.nn import functional as F

from fxforge import export_onnx
from fxforge.exporters.channel_gates import (
    CHANNEL_GATE,
    SPATIAL_MEAN,
    _gate_stays_blocked,
    keep_gates_blocked,
    onnxruntime_keeps_gates_blocked,
)
from fxforge.exporters.onnx_ir import onnxruntime_optimized

X86 = platform.machine().lower() in ("x86_64", "amd64")
needs_blocked_layout = pytest.mark.skipif(not X86, reason="ORT's NCHWc layout is built for x86-64 only")


class SqueezeExcitation(nn.Module):
    """An inverted-residual block's middle as EfficientNet (SiLU, sigmoid gate) and MobileNetV3 (ReLU,
    hard-sigmoid gate) write it: conv, activation, squeeze, two 1x1 convs, gate, excite, project."""

    def __init__(self, channels: int = 32, efficientnet: bool = True, pool: str = "adaptive"):
        super().__init__()
        self.expand = nn.Conv2d(3, channels, 3, padding=1)
        self.act = nn.SiLU() if efficientnet else nn.ReLU()
        self.reduce = nn.Conv2d(channels, 8, 1)
        self.restore = nn.Conv2d(8, channels, 1)
        self.gate = nn.Sigmoid() if efficientnet else nn.Hardsigmoid()
        self.project = nn.Conv2d(channels, 16, 1)
        self.pool = pool

    def forward(self, x):
        a = self.act(self.expand(x))
        squeezed = F.adaptive_avg_pool2d(a, 1) if self.pool == "adaptive" else a.mean((2, 3), keepdim=True)
        return self.project(a * self.gate(self.restore(self.act(self.reduce(squeezed)))))


def _optimized_ops_around_mul(path: str) -> list[str]:
    """The op types ORT's optimizer puts next to each ``Mul`` of the file (what feeds it, what reads it)."""
    graph = onnxruntime_optimized(path)
    made = {output: node.op_type for node in graph.node for output in node.output}
    read = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            read[name].append(node.op_type)
    return [op for node in graph.node if node.op_type == "Mul"
            for op in [made.get(name, "input") for name in node.input] + read[node.output[0]]]


@needs_blocked_layout
def test_the_probe_tells_the_blocked_form_from_torchs():
    assert onnxruntime_keeps_gates_blocked()
    assert not _gate_stays_blocked(spread=False)  # torch's broadcast Mul leaves the layout


@needs_blocked_layout
@pytest.mark.parametrize("efficientnet, pool", [(True, "adaptive"), (False, "adaptive"), (True, "mean")])
def test_gate_stays_blocked_with_the_models_values(efficientnet, pool, tmp_path):
    torch.manual_seed(0)
    model = SqueezeExcitation(efficientnet=efficientnet, pool=pool).eval()
    path = str(tmp_path / "se.onnx")
    result = export_onnx(model, path, (torch.randn(1, 3, 12, 12),))
    assert f"{SPATIAL_MEAN}: 1" in onnx_applied(result.report), result.report
    assert f"{CHANNEL_GATE}: 1" in onnx_applied(result.report), result.report
    around = _optimized_ops_around_mul(path)
    assert around and not {"ReorderInput", "ReorderOutput"} & set(around), around
    assert_runs_like(model, path, torch.randn(1, 3, 12, 12))
    x = torch.randn(1, 3, 12, 12)
    x[0, 1, 3, 4] = float("nan")  # a NaN spreads through the gate's mean as in eager
    assert_runs_like(model, path, x)


@needs_blocked_layout
def test_dynamic_batch_keeps_the_rule(tmp_path):
    torch.manual_seed(0)
    model = SqueezeExcitation().eval()
    path = str(tmp_path / "se.onnx")
    result = export_onnx(model, path, (torch.randn(2, 3, 10, 10),), dynamic_batch=True)
    assert f"{CHANNEL_GATE}: 1" in onnx_applied(result.report), result.report
    assert_runs_like(model, path, torch.randn(3, 3, 10, 10))


@needs_blocked_layout
def test_channels_off_the_block_keep_torchs_gate(tmp_path):
    torch.manual_seed(0)
    model = SqueezeExcitation(channels=24).eval()
    path = str(tmp_path / "se.onnx")
    result = export_onnx(model, path, (torch.randn(1, 3, 12, 12),))
    assert CHANNEL_GATE not in " ".join(onnx_applied(result.report)), result.report
    assert any("channel gate kept as torch wrote it" in line and "24 channels" in line
               for line in onnx_refused(result.report)), result.report
    assert "onnx channel_gates refused: channel gate kept as torch wrote it" in str(result.report)
    assert_runs_like(model, path, torch.randn(1, 3, 12, 12))


# ------------------------------------------------------------------------------------------- IR-level rules

def _value(name: str, shape: list) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(shape))


def _se_model(channels: int, height: int, width: int, *, batch=1, gate_batch=None, gate_from_conv=True,
              seed: int = 0) -> ir.Model:
    """``Conv(x) * Sigmoid(Conv(ReduceMean(Conv(x), [2, 3])))`` (or, not ``gate_from_conv``, the gate is the
    sigmoid of the mean itself); ``gate_batch`` differs from ``batch`` for a gate shared across the batch."""
    rng = np.random.default_rng(seed)
    gate_batch = batch if gate_batch is None else gate_batch

    def weight(name, *shape):
        return ir.Value(name=name, const_value=ir.tensor(rng.standard_normal(shape).astype(np.float32) / 4))

    x = _value("x", [batch, 3, height, width])
    w0, w1 = weight("w0", channels, 3, 1, 1), weight("w1", channels, channels, 1, 1)
    axes = ir.Value(name="axes", const_value=ir.tensor(np.array([2, 3], dtype=np.int64)))
    a = ir.Node("", "Conv", [x, w0], outputs=[_value("a", [batch, channels, height, width])])
    pooled_from = a.outputs[0]
    nodes = [a]
    if gate_batch != batch:  # the gate of the batch's first image, for every image
        starts = ir.Value(name="starts", const_value=ir.tensor(np.array([0], dtype=np.int64)))
        ends = ir.Value(name="ends", const_value=ir.tensor(np.array([1], dtype=np.int64)))
        first = ir.Node("", "Slice", [a.outputs[0], starts, ends],
                        outputs=[_value("first", [1, channels, height, width])])
        nodes.append(first)
        pooled_from = first.outputs[0]
    mean = ir.Node("", "ReduceMean", [pooled_from, axes], outputs=[_value("m", [gate_batch, channels, 1, 1])])
    nodes.append(mean)
    gate_input = mean.outputs[0]
    if gate_from_conv:
        nodes.append(ir.Node("", "Conv", [gate_input, w1], outputs=[_value("s", [gate_batch, channels, 1, 1])]))
        gate_input = nodes[-1].outputs[0]
    sigmoid = ir.Node("", "Sigmoid", [gate_input], outputs=[_value("g", [gate_batch, channels, 1, 1])])
    mul = ir.Node("", "Mul", [a.outputs[0], sigmoid.outputs[0]], outputs=[_value("y", [batch, channels, height, width])])
    nodes += [sigmoid, mul]
    initializers = [w0, w1, axes] + ([starts, ends] if gate_batch != batch else [])
    graph = ir.Graph([x], mul.outputs, nodes=nodes, initializers=initializers, opset_imports={"": 20})
    return ir.Model(graph, ir_version=10)


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    proto = ir.serde.serialize_model(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("case, why", [
    ({"channels": 24}, "24 channels, not a multiple of 16"),
    ({"channels": 32, "gate_from_conv": False}, "an operand is not computed by a Conv"),
    ({"channels": 32, "batch": 2, "gate_batch": 1}, "broadcast over the batch"),
    ({"channels": 32, "height": 1, "width": 1}, None),  # nothing to spread: x is 1x1 already
])
def test_gates_orts_layout_could_not_keep_are_left(case, why):
    shape = {"height": 6, "width": 5, **case}
    model = _se_model(**shape)
    done, refused = keep_gates_blocked(model.graph, blocked=True)
    assert CHANNEL_GATE not in done
    assert not any(node.op_type == "Resize" for node in model.graph)
    assert [why in reason for reason in refused] == ([True] if why else []), refused


def test_a_runtime_without_the_blocked_layout_changes_nothing():
    model = _se_model(32, 6, 5)
    assert keep_gates_blocked(model.graph, blocked=False) == ({}, [])
    assert [node.op_type for node in model.graph] == ["Conv", "ReduceMean", "Conv", "Sigmoid", "Mul"]


def test_dynamic_spatial_dims_are_refused():
    model = _se_model(32, 6, 5)
    mul = next(node for node in model.graph if node.op_type == "Mul")
    mul.inputs[0].shape = ir.Shape([1, 32, "height", "width"])
    done, refused = keep_gates_blocked(model.graph, blocked=True)
    assert CHANNEL_GATE not in done
    assert len(refused) == 1 and "not known at export time" in refused[0], refused


@st.composite
def _blocks(draw):
    return {"channels": draw(st.sampled_from([16, 24, 32, 48])), "height": draw(st.integers(1, 9)),
            "width": draw(st.integers(1, 9)), "batch": draw(st.integers(1, 3)), "seed": draw(st.integers(0, 2**16))}


@settings(max_examples=30, deadline=None)
@given(_blocks())
def test_random_blocks_answer_as_before(case):
    model = _se_model(**case)
    x = np.random.default_rng(case["seed"]).standard_normal((case["batch"], 3, case["height"], case["width"]))
    x = x.astype(np.float32)
    expected = _run(model, x)
    done, _ = keep_gates_blocked(model.graph, blocked=True)
    assert done.get(SPATIAL_MEAN) == 1, done
    spread = case["channels"] % 16 == 0 and (case["height"], case["width"]) != (1, 1)
    assert done.get(CHANNEL_GATE, 0) == int(spread), done
    # the spread gate is exact; the pool sums in another order than ReduceMean
    np.testing.assert_allclose(_run(model, x), expected, rtol=1e-5, atol=1e-6)


def test_the_probe_leaves_no_file_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _gate_stays_blocked(spread=True)
    assert os.listdir(tmp_path) == []
