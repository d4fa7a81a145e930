"""fxforge's TorchDynamo backend: which of a dynamo graph's inputs are the model's tensors, the host module that
holds them, and the breaks named from dynamo's records."""

from __future__ import annotations

import torch
from torch import nn

import fxforge
from fxforge.capture.dynamo import (
    CompiledGraph,
    attribute_path,
    capture_dynamo,
    compiled_forward,
    host_module,
    layout_of,
    own_graph,
)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.norm(self.layers[0](x))
        if h.sum() > 0:
            h = h * 2
        return self.layers[1](h)


def _graphs(model, *inputs):
    """``(graph, example inputs, layout)`` of each graph dynamo hands a backend (the layout read in the backend:
    dynamo drops the placeholders' sources once the compile is done)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs), layout_of(gm, list(example_inputs))))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model.forward, backend=backend)(*inputs)
    return seen


def test_attribute_path_reads_dynamos_source_names():
    assert attribute_path("L['self']._modules['norm']._buffers['running_mean']") == "norm.running_mean"
    assert attribute_path("L['self']._modules['layers']._modules['1']._parameters['bias']") == "layers.1.bias"
    assert attribute_path("L['self']._modules['layers']") is None  # a module, not a tensor
    assert attribute_path("L['x']") is None


def test_the_layout_binds_parameters_and_buffers_and_keeps_the_inputs():
    model = Branchy().eval()
    (_gm, examples, layout), _ = _graphs(model, torch.randn(3, 4))
    assert set(layout.names) == {"layers.0.weight", "layers.0.bias", "norm.running_mean", "norm.running_var",
                                 "norm.weight", "norm.bias"}
    assert [examples[i].shape for i in layout.kept] == [torch.Size([3, 4])]
    assert layout.dynamic == frozenset() and layout.sizes == {}


def test_the_host_holds_the_models_own_tensors_as_parameters_and_buffers():
    model = Branchy().eval()
    (gm, examples, layout), _ = _graphs(model, torch.randn(3, 4))
    host = host_module(gm, layout, [examples[i] for i in layout.bound], training=False)
    assert host.get_parameter("layers.0.weight") is model.layers[0].weight
    assert host.get_buffer("norm.running_mean") is model.norm.running_mean  # a buffer, watched as one
    x = torch.randn(3, 4)
    torch.testing.assert_close(host(x), gm(*[x if i in layout.kept else e for i, e in enumerate(examples)]))
    assert not host.training and own_graph(host) is not None and own_graph(model) is None


def test_sizes_dynamo_passes_as_ints_are_read_off_the_tensors():
    model = nn.Sequential(nn.Linear(4, 4))

    def forward(x):
        return model(x).reshape(x.shape[0], 2, 2)

    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs), layout_of(gm, list(example_inputs))))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(forward, backend=backend)
    compiled(torch.randn(2, 4))
    compiled(torch.randn(5, 4))  # a new size: dynamo compiles again with the batch symbolic
    gm, examples, layout = seen[-1]
    assert layout.sizes and layout.dynamic == frozenset({(0, 0)})
    host = host_module(gm, layout, [examples[i] for i in layout.bound], training=False)
    assert not any("SymInt" in str(node.type) for node in host.graph.nodes if node.op == "placeholder")
    x = torch.randn(7, 4)
    torch.testing.assert_close(host(x)[0], forward(x))  # (dynamo's graphs return tuples)


def test_capture_dynamo_returns_each_graph_its_inputs_and_the_break():
    model = Branchy().eval()
    found = capture_dynamo(model, (torch.randn(3, 4),))
    assert len(found.graphs) == 2 and found.method == "dynamo"
    assert [b.code for b in found.breaks] == ["if h.sum() > 0:"]
    assert found.breaks[0].line.endswith(f"test_dynamo_capture.py:{Branchy.forward.__code__.co_firstlineno + 2}")
    graph, host, inputs = found.graphs[0]
    assert isinstance(graph, CompiledGraph) and graph.ends == found.breaks[0]
    assert found.calls == {g.index: 1 for g, _, _ in found.graphs}
    with torch.no_grad():
        assert host(*inputs)[1].shape == (3, 4)  # (the branch's condition, the features)


def test_capture_method_dynamo_is_the_public_door():
    found = fxforge.capture(Branchy().eval(), (torch.randn(3, 4),), method="dynamo")
    assert found.method == "dynamo" and len(found.graph_modules) == 2


def test_a_compiled_graph_without_an_owner_runs_dynamos_graph():
    model = Branchy().eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled_forward(model.forward)(x), model(x))


def test_a_break_in_a_loop_is_named_from_dynamos_compilation_metrics():
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            for _ in range(3):
                x = self.fc(x)
                if x.sum() > 100:
                    break
            return x

    found = capture_dynamo(Loop().eval(), (torch.randn(2, 4),))
    assert [b.code for b in found.breaks] == ["if x.sum() > 100:"]
    assert "dynamo runs forward() in Python (a break inside a loop)" in found.breaks[0].reason


def test_a_break_seen_again_from_another_directory_is_one_break(tmp_path, monkeypatch):
    """A break's line is shortened to the directory current when it was seen: the same break met again after a
    chdir (the CLI's tests write into a temporary directory) is still one break, not one per spelling."""
    first = capture_dynamo(Branchy().eval(), (torch.randn(3, 4),))
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()  # (dynamo meets the break anew, and names it from the new directory)
    again = capture_dynamo(Branchy().eval(), (torch.randn(3, 4),))
    assert [b.code for b in again.breaks] == ["if h.sum() > 0:"], [b.line for b in again.breaks]
    assert again.breaks[0].line == first.breaks[0].line  # (the first record kept)
