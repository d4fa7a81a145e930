"""``fxforge.capture``: opaque-leaf fallback, torch.export, the "auto" choice, errors that name the user's
line, keyword inputs, node metadata, shared parameters, and training mode (dropout, BatchNorm)."""

from __future__ import annotations

import inspect
import operator
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import fxforge
from fxforge.capture import CaptureError, OpaqueModule
from fxforge.core.verify import compare_outputs, isolated
from fxforge.lowering.autotune import TuningPolicy

THIS_FILE = os.path.basename(__file__)


def line_of(code: str) -> int:
    """The line number of ``code`` in this file (it must occur exactly once)."""
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if line.strip() == code]
    assert len(hits) == 1, (code, hits)
    return hits[0]


def assert_names_line(where: str | None, code: str) -> None:
    """``where`` is ``.../test_capture.py:LINE: code`` for the line holding ``code``."""
    assert where is not None
    assert f"{THIS_FILE}:{line_of(code)}: {code}" in where, where


# --- submodules symbolic tracing cannot get through ------------------------------------------------------


class DataDependentGate(nn.Module):
    """Control flow on a tensor's value: no tracer can follow it without data."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


class FillLowest(nn.Module):
    """``x.dtype`` used as a Python value (as attention-mask code does)."""

    def forward(self, x):
        lowest = torch.finfo(x.dtype).min
        return x.masked_fill(x < -0.5, lowest / 2)


class ZeroFirstColumn(nn.Module):
    """Item assignment on a traced value."""

    def forward(self, x):
        y = x.clone()
        y[:, 0] = 0.0
        return y


BREAKS = {
    # name: (submodule class, the line where tracing breaks, what the reason says)
    "data_dependent_if": (DataDependentGate, "if x.sum() > 0:", "control flow"),
    "item_assignment": (ZeroFirstColumn, "y[:, 0] = 0.0", "item assignment"),
}


class Net(nn.Module):
    """Linear -> ``inner`` -> Linear, so the break is inside a submodule, between traceable code."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = inner
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.inner(self.lin(x)).relu())


class Block(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.gate = inner

    def forward(self, x):
        return self.gate(self.norm(x)) + x


class Deep(nn.Module):
    """The break two levels down: only the innermost module becomes opaque."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(nn.Identity()), Block(DataDependentGate()))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


def test_many_modules_opaque_for_one_reason_are_one_report_line():
    model = nn.Sequential(*(Block(DataDependentGate()) for _ in range(5)), Block(nn.Identity())).eval()
    cap = fxforge.capture(model, (torch.randn(2, 4),), method="fx")
    assert [o.name for o in cap.opaque] == [f"{i}.gate" for i in range(5)]  # each module, as before
    lines = [line for line in str(cap.report).splitlines() if "opaque" in line]
    assert len(lines) == 1 and "5 DataDependentGate modules (0.gate, 1.gate, 2.gate and 2 more)" in lines[0], lines
    assert cap.opaque[0].reason in lines[0]
    html = cap.report._repr_html_()
    assert html.count("DataDependentGate") == 1 and "0.gate, 1.gate, 2.gate and 2 more" in html


class ShapeBuilt(nn.Module):
    """Tensors built from traced sizes and a dtype: plain Python values to these torch functions."""

    def forward(self, q):
        zeros = torch.zeros(q.size(0), q.size(1), dtype=q.dtype)
        ones = torch.ones((q.shape[0], 4))
        noise = torch.randn(q.size(0), 4) * 1e-3
        steps = torch.arange(q.size(1), dtype=q.dtype)
        floor = torch.finfo(q.dtype).min
        lowest = torch.tensor(torch.finfo(q.dtype).min)  # DistilBERT's fill value
        scores = (q + zeros + steps).masked_fill(q > 2, lowest)
        return scores.amax(-1, keepdim=True).clamp(min=floor) + ones + noise


def test_fx_traces_a_dtype_used_as_a_value():
    # torch.finfo(x.dtype) broke symbolic tracing (the submodule became opaque, and "auto" chose export)
    model, inputs = make("dtype_as_value")
    for method in ("fx", "auto"):
        cap = fxforge.capture(model, inputs, method=method)
        assert (cap.method, cap.opaque) == ("fx", []), cap.report
        reproduces(model, cap, (torch.randn(3, 4),))


def test_fx_records_tensors_built_from_traced_sizes_and_dtypes():
    model, zeros, finfo = ShapeBuilt(), torch.zeros, torch.finfo
    cap = fxforge.capture(model, (torch.randn(3, 5),), method="fx")
    assert (cap.method, cap.opaque) == ("fx", [])
    targets = {n.target for n in cap.graph_module.graph.nodes}
    assert {torch.zeros, torch.ones, torch.randn, torch.arange, torch.finfo, torch.tensor} <= targets
    reproduces(model, cap, (torch.randn(3, 5),))  # fresh values; random draws under the same seed
    assert torch.zeros is zeros and torch.finfo is finfo  # put back after the trace


class RootIf(nn.Module):
    """Data-dependent control flow in the root forward: nothing can capture it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.max() > 0:
            return y
        return -y


class Picky(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        if x.shape[1] != 3:
            raise ValueError(f"expected 3 channels, got {x.shape[1]}")
        return self.conv(x)


def make(name: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    inner = FillLowest if name == "dtype_as_value" else BREAKS[name][0]
    return Net(inner()).eval(), (torch.randn(3, 4),)


def reproduces(model: nn.Module, cap: fxforge.Captured, inputs) -> None:
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    with isolated(model), torch.no_grad():
        expected = model(*args, **kwargs)
    with isolated(model), torch.no_grad():
        actual = cap.graph_module(*args, **kwargs)
    result = compare_outputs(expected, actual)
    assert result.ok, result.reason


# --- the fx method: opaque leaves ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_fx_keeps_the_breaking_submodule_opaque(name):
    cls, code, reason = BREAKS[name]
    model, inputs = make(name)
    cap = fxforge.capture(model, inputs, method="fx")
    assert cap.method == "fx"
    assert len(cap.opaque) == 1
    leaf = cap.opaque[0]
    assert isinstance(leaf, OpaqueModule)
    assert (leaf.name, leaf.type) == ("inner", cls.__name__)
    assert reason in leaf.reason
    assert_names_line(leaf.source, code)
    assert f"inner ({cls.__name__})" in str(leaf) and code in str(leaf)
    # The leaf is called as a whole; the code around it is traced.
    graph = cap.graph_module.graph
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["lin", "inner", "out"]
    assert any(n.op == "call_method" and n.target == "relu" for n in graph.nodes)
    assert cap.graph_module.get_submodule("inner") is model.inner
    assert cap.report.opaque == cap.opaque
    reproduces(model, cap, inputs)


def test_fx_makes_only_the_innermost_breaking_module_opaque():
    model, inputs = Deep().eval(), (torch.randn(2, 4),)
    cap = fxforge.capture(model, inputs, method="fx")
    assert [o.name for o in cap.opaque] == ["blocks.1.gate"]
    targets = [n.target for n in cap.graph_module.graph.nodes if n.op == "call_module"]
    assert "blocks.1.gate" in targets and "blocks.1.norm" in targets and "blocks.0.norm" in targets
    reproduces(model, cap, inputs)


def test_fx_without_a_break_has_no_leaves():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    cap = fxforge.capture(model, (torch.randn(2, 4),), method="fx")
    assert (cap.method, cap.opaque) == ("fx", [])
    # Shapes were recorded during the run that checked the capture: no second pass over the graph.
    assert cap.report.meta_source == "check"


# --- the export method -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dtype_as_value", "item_assignment"])
def test_export_captures_what_symbolic_tracing_cannot(name):
    model, inputs = make(name)
    cap = fxforge.capture(model, inputs, method="export")
    assert (cap.method, cap.opaque) == ("export", [])
    assert all(n.op != "call_module" for n in cap.graph_module.graph.nodes), "export inlines every module"
    targets = {n.target for n in cap.graph_module.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.linear.default in targets
    reproduces(model, cap, inputs)


def test_export_refuses_data_dependent_control_flow_naming_the_line():
    model, inputs = make("data_dependent_if")
    with pytest.raises(CaptureError) as info:
        fxforge.capture(model, inputs, method="export")
    assert set(info.value.reasons) == {"export"}
    assert_names_line(info.value.reasons["export"], "if x.sum() > 0:")
    assert "cannot capture Net: export:" in str(info.value)


def test_export_keeps_the_output_structure():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 3)

        def forward(self, x):
            return {"a": self.a(x), "pair": (self.b(x), x.shape[0])}

    model, x = TwoHeads().eval(), torch.randn(2, 4)
    for method in ("fx", "export"):
        out = fxforge.capture(model, (x,), method=method).graph_module(x)
        assert isinstance(out, dict) and isinstance(out["pair"], tuple), method
        assert compare_outputs(model(x), out).ok, method


# --- symbolic tracing through shape checks and returned dict types -------------------------------------------


class ChecksChannels(nn.Module):
    """Input validation on shapes (as transformers' embeddings do) and a number taken from a shape."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[-1] != self.lin.in_features:
            raise ValueError("wrong number of features")
        rows = int(x.shape[0])
        return self.lin(x).view(rows, -1)


def test_fx_decides_shape_only_branches_from_the_example_and_guards_them():
    model = ChecksChannels()
    cap = fxforge.capture(model, (torch.randn(3, 4),), method="auto")
    assert (cap.method, cap.opaque) == ("fx", [])
    reproduces(model, cap, (torch.randn(3, 4),))
    asserts = [n for n in cap.graph_module.graph.nodes if n.target is torch._assert]
    assert len(asserts) == 2  # the branch and int(x.shape[0])
    # Inputs whose shapes would take another branch (or give another number) fail loudly.
    with pytest.raises(AssertionError, match="fxforge: the graph was traced for inputs where"):
        cap.graph_module(torch.randn(2, 4))


def test_fx_still_refuses_a_branch_on_tensor_data():
    model = Net(DataDependentGate())
    cap = fxforge.capture(model, (torch.randn(3, 4),), method="fx")
    assert [o.name for o in cap.opaque] == ["inner"]


class NamedOutput(dict):
    """A dict subclass taking its keys as keyword arguments, registered as a pytree, like transformers'
    ``ModelOutput``."""


pytree.register_pytree_node(
    NamedOutput,
    lambda d: (list(d.values()), list(d)),
    lambda values, keys: NamedOutput(zip(keys, values)),
    flatten_with_keys_fn=lambda d: ([(pytree.MappingKey(k), v) for k, v in d.items()], list(d)),
)


class ReturnsNamedOutput(nn.Module):
    def forward(self, x):
        return NamedOutput(double=x * 2, half=x / 2)


def test_fx_graph_returns_the_models_own_dict_type():
    model = ReturnsNamedOutput()
    cap = fxforge.capture(model, (torch.randn(2),), method="fx")
    out = cap.graph_module(torch.ones(2))
    assert type(out) is NamedOutput and list(out) == ["double", "half"]
    # Interpreter runs (shape propagation, profiling) see the same type.
    assert type(torch.fx.Interpreter(cap.graph_module).run(torch.ones(2))) is NamedOutput
    rewritten = fxforge.rewrite(cap)
    assert type(rewritten.graph_module(torch.ones(2))) is NamedOutput


@pytest.mark.slow
def test_transformers_resnet_is_symbolically_traced():
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1], num_labels=3)
    model = ResNetForImageClassification(config).eval()
    x = torch.randn(1, 3, 32, 32)
    cap = fxforge.capture(model, (x,))
    assert (cap.method, cap.opaque, cap.report.notes) == ("fx", [], [])
    assert type(cap.graph_module(x)) is type(model(x))
    reproduces(model, cap, (x,))


# --- auto ----------------------------------------------------------------------------------------------------


def test_auto_chooses_fx_when_no_leaf_is_needed():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    cap = fxforge.capture(model, (torch.randn(1, 3, 8, 8),))
    assert (cap.method, cap.opaque, cap.report.method) == ("fx", [], "fx")
    assert cap.report.notes == []


@pytest.mark.parametrize("name", ["item_assignment"])
def test_auto_chooses_export_when_fx_would_need_leaves(name):
    model, inputs = make(name)
    cap = fxforge.capture(model, inputs, method="auto")
    assert (cap.method, cap.opaque, cap.report.method) == ("export", [], "export")
    # The report says why the symbolic trace was not used, and where it broke.
    assert any("symbolic trace not used" in note and BREAKS[name][1] in note for note in cap.report.notes)
    reproduces(model, cap, inputs)


def test_auto_falls_back_to_fx_with_leaves_when_export_fails():
    model, inputs = make("data_dependent_if")
    cap = fxforge.capture(model, inputs, method="auto")
    assert cap.method == "fx" and [o.name for o in cap.opaque] == ["inner"]
    note = next(n for n in cap.report.notes if "torch.export failed" in n)
    assert "if x.sum() > 0:" in note
    assert cap.report.meta_source == "check"  # shapes recorded during the checking run
    # Without that run, fake tensors cannot run data-dependent Python: metadata comes from a real run, and
    # the report says so.
    unchecked = fxforge.capture(model, inputs, method="fx", check=False)
    assert unchecked.report.meta_source == "real"
    assert any("real run" in n for n in unchecked.report.notes)
    reproduces(model, cap, inputs)
    # Both branches of the opaque gate still work: it runs eagerly inside the graph.
    flipped = (-100 * torch.ones(3, 4),)
    with torch.no_grad():
        assert torch.equal(cap.graph_module(*flipped), model(*flipped))


# --- errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["auto", "fx", "export"])
def test_nothing_captures_raises_naming_each_method_and_the_line(method):
    with pytest.raises(CaptureError) as info:
        fxforge.capture(RootIf().eval(), (torch.randn(2, 4),), method=method)
    tried = {"auto": {"fx", "export"}, "fx": {"fx"}, "export": {"export"}}[method]
    assert set(info.value.reasons) == tried
    message = str(info.value)
    assert message.startswith("cannot capture RootIf:")
    for m in tried:
        assert f"{m}: " in message
        assert_names_line(info.value.reasons[m], "if y.max() > 0:")


@pytest.mark.parametrize("method", ["auto", "fx", "export"])
def test_a_model_that_raises_on_its_inputs_says_so(method):
    with pytest.raises(CaptureError) as info:
        fxforge.capture(Picky(), (torch.randn(1, 2, 8, 8),), method=method)
    message = str(info.value)
    assert "the module raised on the example inputs" in message
    assert "ValueError: expected 3 channels, got 2" in message
    assert_names_line(message, 'raise ValueError(f"expected 3 channels, got {x.shape[1]}")')


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown capture method 'jit'"):
        fxforge.capture(nn.ReLU(), (torch.ones(1),), method="jit")


# --- keyword inputs ------------------------------------------------------------------------------------------


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale: float = 2.0, shift=False):
        y = self.lin(x)
        if mask is not None:
            y = y.masked_fill(mask == 0, 0.0)
        if shift:
            y = y + 1
        return {"y": y * scale, "mask_given": mask is not None}


MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize(
    "inputs",
    [
        {"x": torch.randn(2, 4), "mask": MASK},
        {"x": torch.randn(2, 4)},
        {"x": torch.randn(2, 4), "mask": None, "shift": True, "scale": 3.0},
    ],
    ids=["mask", "no_mask", "python_values"],
)
def test_keyword_inputs(method, inputs):
    model = Masked().eval()
    cap = fxforge.capture(model, inputs, method=method)
    assert cap.method == method
    assert cap.example_args == () and set(cap.example_kwargs) == set(inputs)
    reproduces(model, cap, inputs)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_python_value_inputs_are_specialised_loudly(method):
    """A graph built for ``scale=3.0`` refuses ``scale=4.0`` rather than ignoring it."""
    model, x = Masked().eval(), torch.randn(2, 4)
    cap = fxforge.capture(model, {"x": x, "scale": 3.0, "shift": True}, method=method)
    assert compare_outputs(model(x, scale=3.0, shift=True), cap.graph_module(x=x, scale=3.0, shift=True)).ok
    with pytest.raises(AssertionError, match="scale has been specialized to have value 3.0"):
        cap.graph_module(x=x, scale=4.0, shift=True)
    with pytest.raises(AssertionError, match="shift has been specialized to have value True"):
        cap.graph_module(x=x, scale=3.0, shift=False)


def test_fx_graph_takes_the_modules_keyword_arguments():
    cap = fxforge.capture(Masked().eval(), {"x": torch.randn(2, 4), "scale": 3.0}, method="fx")
    assert list(inspect.signature(cap.graph_module.forward).parameters) == ["x", "mask", "scale", "shift"]


# --- metadata --------------------------------------------------------------------------------------------------


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = self.conv(x).relu()
        pooled = y.mean(dim=(2, 3))
        return self.fc(pooled).to(torch.float64)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_every_node_has_shape_dtype_and_source(method):
    model, x = Small().eval(), torch.randn(2, 3, 6, 6)
    cap = fxforge.capture(model, (x,), method=method)
    graph = cap.graph_module.graph
    for node in graph.nodes:
        if node.op in ("call_function", "call_module", "call_method", "placeholder", "get_attr"):
            assert "val" in node.meta, node.name
            if isinstance(node.meta["val"], torch.Tensor):
                meta = node.meta["tensor_meta"]
                assert tuple(meta.shape) == tuple(node.meta["val"].shape) and meta.dtype == node.meta["val"].dtype
    out = graph.find_nodes(op="output")[0].args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert tuple(out.meta["val"].shape) == (2, 5) and out.meta["val"].dtype == torch.float64
    assert isinstance(out.meta["val"], torch._subclasses.fake_tensor.FakeTensor)
    # Nodes made from the user's lines name those lines.
    sources = [n.meta.get("fxforge_source", "") for n in graph.nodes]
    for code in ("y = self.conv(x).relu()", "pooled = y.mean(dim=(2, 3))", "return self.fc(pooled).to(torch.float64)"):
        assert any(f"{THIS_FILE}:{line_of(code)}: {code}" in s for s in sources), (code, sources)
    mean = next(n for n in graph.nodes if "pooled = y.mean" in n.meta.get("fxforge_source", ""))
    assert tuple(mean.meta["val"].shape) == (2, 8)


def test_metadata_is_fake_and_costs_no_real_run():
    calls = []

    class Counting(nn.Module):
        def forward(self, x):
            calls.append(1)
            return x + 1

    model = nn.Sequential(Counting(), nn.Linear(3, 3))
    cap = fxforge.capture(model, (torch.randn(2, 3),), method="fx", check=False)
    assert cap.report.meta_source == "fake"
    assert calls == [1], "only the trace itself ran the user's forward"


# --- parameters, buffers, training -----------------------------------------------------------------------------


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        y = self.bn(self.conv(x)).relu()
        y = self.drop(y.mean(dim=(2, 3)))
        return self.fc(F.dropout(y, 0.3, self.training))


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_parameters_and_buffers_are_the_modules_own(method, training):
    model = BNNet().train(training)
    cap = fxforge.capture(model, (torch.randn(2, 3, 6, 6),), method=method)
    params = dict(model.named_parameters())
    graph_params = dict(cap.graph_module.named_parameters())
    assert graph_params.keys() == params.keys()
    assert all(graph_params[k] is params[k] for k in params)
    buffers = dict(model.named_buffers())
    assert all(b is buffers[k] for k, b in cap.graph_module.named_buffers())
    assert cap.training is training


@pytest.mark.parametrize("method", ["fx", "export"])
def test_training_mode_dropout_gradients_and_batchnorm_match_eager(method):
    torch.manual_seed(0)
    model, x = BNNet().train(), torch.randn(4, 3, 6, 6)
    cap = fxforge.capture(model, (x,), method=method)
    assert cap.method == method and cap.training

    def step(fn, seed):
        model.zero_grad(set_to_none=True)
        with isolated(model, seed=seed):
            out = fn(x)
            out.square().sum().backward()
        return out.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}

    out_eager, grads_eager = step(model, 3)
    out_graph, grads_graph = step(cap.graph_module, 3)
    assert compare_outputs(out_eager, out_graph).ok, "same seed: the graph draws the same dropout masks"
    assert compare_outputs(grads_eager, grads_graph).ok
    assert not compare_outputs(out_eager, step(model, 4)[0]).ok, "dropout is live in this test"

    # A step outside isolated(): BatchNorm running statistics move as in eager, on the model's own buffers.
    before = {k: b.clone() for k, b in model.named_buffers()}
    model(x)
    after_eager = {k: b.clone() for k, b in model.named_buffers()}
    with torch.no_grad():
        for k, b in model.named_buffers():
            b.copy_(before[k])
    cap.graph_module(x)
    after_graph = dict(model.named_buffers())
    assert not torch.equal(before["bn.running_mean"], after_graph["bn.running_mean"])
    assert int(after_graph["bn.num_batches_tracked"]) == 1
    assert compare_outputs(after_eager, after_graph).ok


def test_export_training_graph_keeps_dropout_as_the_eager_op():
    """torch.export keeps ``aten.dropout`` (the op eager runs) rather than a decomposition drawing its
    random numbers another way, which is why the same seed gives the same masks."""
    cap = fxforge.capture(BNNet().train(), (torch.randn(2, 3, 6, 6),), method="export")
    targets = [n.target for n in cap.graph_module.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.dropout.default) == 2
    assert not {torch.ops.aten.bernoulli.p, torch.ops.aten.native_dropout.default} & set(targets)


@pytest.mark.parametrize("method", ["auto", "fx", "export"])
def test_capture_does_not_change_the_model(method):
    torch.manual_seed(0)
    model, x = BNNet().train(), torch.randn(2, 3, 6, 6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    fxforge.capture(model, (x,), method=method)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training


def test_specialisation_checks_are_plain_graph_nodes():
    """Export graphs carry no guard submodule: only the asserts for Python-value inputs."""
    cap = fxforge.capture(Masked().eval(), {"x": torch.randn(2, 4), "scale": 3.0}, method="export")
    gm = cap.graph_module
    assert not hasattr(gm, "_guards_fn")
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][:2] == [operator.eq, torch._assert]


def test_tracing_records_stack_traces_without_importing_torch_export(tmp_path):
    # torch's own stack-trace filter imports torch.export, Inductor and networkx (a quarter of a second)
    # on the first traced node; fxforge's tracer filters the same frames without them.
    import subprocess
    import sys

    (tmp_path / "user_model.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.conv = torch.nn.Conv2d(3, 4, 3)\n"
        "    def forward(self, x):\n"
        "        return self.conv(x).relu()\n"
    )
    code = (
        "import sys, torch, fxforge, user_model\n"
        "cap = fxforge.capture(user_model.Net().eval(), (torch.randn(1, 3, 8, 8),), method='fx')\n"
        "print(sorted({n.meta.get('fxforge_source', '').split('/')[-1] for n in cap.graph_module.graph.nodes} - {''}))\n"
        "print(sorted(m for m in ('torch.export._trace', 'networkx', 'torch._inductor.codecache') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    sources, imported = result.stdout.strip().splitlines()[-2:]
    assert sources == "['user_model.py:7: return self.conv(x).relu()']", sources
    assert imported == "[]", imported


class _ConstantInForward(nn.Module):
    """Builds a tensor constant on every call, as torchvision's MaxVit builds its relative positions."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_fx_capture_leaves_no_stowed_constant_on_the_model():
    model = _ConstantInForward().eval()
    before = set(vars(model))
    cap = fxforge.capture(model, (torch.randn(2, 4),), method="fx")
    assert set(vars(model)) == before  # torch.fx stows the constant on the root; the GraphModule keeps it
    x = torch.randn(3, 4)
    assert torch.equal(cap.graph_module(x), model(x))


def test_a_forward_building_tensor_constants_is_optimized_not_run_eagerly():
    model = _ConstantInForward().eval()
    opt = fxforge.optimize(model, (torch.randn(2, 4),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FallbackWarning ("its forward sets ... on every call") fails
        for rows in (2, 5, 2):
            x = torch.randn(rows, 4)
            with torch.no_grad():
                assert compare_outputs(model(x), opt(x)).ok
    assert opt.plans_built == 1  # the example's torch.fx plan serves every batch size once checked against eager


def test_torch_compile_still_works_after_an_fx_capture():
    # torch.fx imported torch._dynamo while fxforge's stand-ins for torch.finfo/iinfo were in place, and dynamo
    # kept them among its constant types: every torch.compile guard on a constant then raised a TypeError.
    # The guards are TorchDynamo's, built whatever the backend: backend="eager" raises that same TypeError
    # (checked with the stand-ins in place while torch._dynamo.utils is first imported) without an Inductor
    # compile (a minute on a cold cache under a loaded ``-n 2``).
    code = ("import torch, fxforge\nfrom torch import nn\n"
            "fxforge.capture(nn.Sequential(nn.Linear(2, 2)), (torch.randn(1, 2),), method='fx')\n"
            "m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()\n"
            "print(tuple(torch.compile(m, backend='eager')(torch.randn(1, 3, 8, 8)).shape))\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "(1, 4, 6, 6)" in done.stdout, done.stderr[-2000:]


# ------------------------------------------------------------------------------------ work kept whole

def projected(x, weight):
    """A library function that ``torch.fx.wrap`` keeps whole, handed a weight (like torchvision's
    ``shifted_window_attention``)."""
    return F.linear(x, weight).relu()


def dropped(x, p: float, training: bool):
    """A library function kept whole that is handed no weight (like torchvision's ``stochastic_depth``)."""
    return F.dropout(x, p, training)


torch.fx.wrap("projected")
torch.fx.wrap("dropped")


class AttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.fc = nn.MultiheadAttention(16, 4, batch_first=True), nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(self.attn(x, x, x, need_weights=False)[0] + x)


class Wrapped(nn.Module):
    def __init__(self, use_weight: bool):
        super().__init__()
        self.weight, self.use_weight = nn.Parameter(torch.randn(8, 8)), use_weight

    def forward(self, x):
        return projected(x, self.weight) if self.use_weight else dropped(x, 0.1, self.training) * 2


def test_auto_captures_with_export_where_a_trace_keeps_attention_or_a_weighted_library_function_whole():
    block, x = AttentionBlock().eval(), torch.randn(2, 5, 16)
    cap = fxforge.capture(block, (x,))
    assert cap.method == "export"
    assert "keeps whole what the rewrites cannot see into: 1 MultiheadAttention module (attn)" in cap.report.notes[0]
    assert fxforge.capture(block, (x,), method="fx").method == "fx"  # asked for: the leaf stays
    opt = fxforge.optimize(block, (x,), tuning=TuningPolicy(keep="fused", kernel="mkldnn"))
    assert opt.report.counts.get("conv_activation", 0) >= 3  # in-projection, out-projection, fc: all seen now
    fresh = torch.randn(3, 7, 16)
    with torch.no_grad():
        torch.testing.assert_close(opt(fresh), block(fresh), rtol=1e-5, atol=1e-5)
    seen = []
    handle = block.attn.register_forward_hook(lambda *_: seen.append(1))
    hooked = fxforge.capture(block, (x,))
    assert hooked.method == "fx"  # a hooked layer stays a module call, so that its hook fires
    seen.clear()
    hooked.graph_module(x)
    assert seen == [1]
    handle.remove()
    assert fxforge.capture(Wrapped(True).eval(), (torch.randn(2, 8),)).method == "export"
    assert fxforge.capture(Wrapped(False).eval(), (torch.randn(2, 8),)).method == "fx"  # nothing hidden
