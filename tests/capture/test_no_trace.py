"""fxforge leaves no trace in the user's model (issue 50): a capture, failed or finished, leaves no attribute,
cache entry, buffer, parameter or proxy behind, so a second capture of the same instance works and the state
watch never blames the model's forward for what tracing wrote (a model run eagerly for good)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxforge
from fxforge.core.verify import compare_outputs
from fxforge.runtime.plans import FallbackWarning


class BiasCache(nn.Module):
    """LeViT's attention biases: in eval mode, a dict cache filled on first use, keyed by the input's device."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.biases = nn.Parameter(torch.randn(4))
        self.register_buffer("idx", torch.tensor([0, 1, 2, 3, 3, 2, 1, 0]))
        self.cache = {}

    def forward(self, x):
        if self.training:
            return self.fc(x) + self.biases[self.idx]
        key = str(x.device)
        if key not in self.cache:
            self.cache[key] = self.biases[self.idx]
        return self.fc(x) + self.cache[key]


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # a branch on data: torch.fx breaks here, torch.export too
            return x
        return -x


class StowsThenBreaks(nn.Module):
    """Builds a tensor constant (torch.fx stows it on the root) before a submodule where tracing breaks, as
    transformers' Swinv2 does: the failed trace used to leave ``_tensor_constant0`` on the model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()
        self.blocks = nn.ModuleList([BiasCacheLike() for _ in range(2)])

    def forward(self, x):
        x = self.fc(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])
        for block in self.blocks:
            x = block(x)
        return self.gate(x)


class BiasCacheLike(nn.Module):
    """A cache keyed by shape, and a list of the sizes seen, filled the first time a size is seen."""

    def __init__(self):
        super().__init__()
        self.cache: dict = {}
        self.sizes: list = []

    def forward(self, x):
        key = str(x.shape[-1])
        if key not in self.cache:
            self.cache[key] = torch.ones(x.shape[-1]) * 0.5
            self.sizes.append(key)
        return x + self.cache[key]


def _state(model: nn.Module) -> dict:
    """Every module's attribute names, the contents of its dict, list and set attributes (values by identity),
    and its buffers and parameters (by identity)."""
    found = {}
    for name, module in model.named_modules():
        containers = {k: (sorted((str(key), id(value)) for key, value in v.items()) if isinstance(v, dict)
                          else sorted(map(id, v)))
                      for k, v in vars(module).items() if type(v) in (dict, list, set) and not k.startswith("_")}
        found[name] = (sorted(vars(module)), containers, {k: id(v) for k, v in module._buffers.items()},
                       {k: id(v) for k, v in module._parameters.items()})
    return found


def _no_stand_ins(model: nn.Module) -> None:
    """No proxy or fake tensor anywhere in the modules' attributes or their containers."""
    for module in model.modules():
        for value in vars(module).values():
            values = list(value.keys()) + list(value.values()) if isinstance(value, dict) else (
                list(value) if isinstance(value, (list, set, tuple)) else [value])
            for v in values:
                assert not isinstance(v, torch.fx.Proxy), (type(module).__name__, v)
                assert not isinstance(v, torch._subclasses.FakeTensor), (type(module).__name__, v)


def _swinv2():
    transformers = pytest.importorskip("transformers")
    config = transformers.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                       window_size=4)
    torch.manual_seed(0)
    return transformers.Swinv2Model(config).eval(), lambda batch: torch.randn(batch, 3, 32, 32)


def small_levit():
    """A small transformers LeViT with weights that give outputs of order 0.1, and a maker of its inputs."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LevitConfig(image_size=64, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3],
                                      depths=[1, 1, 1], key_dim=[8, 8, 8], patch_size=16,
                                      down_ops=[["Subsample", 8, 2, 4, 2, 2], ["Subsample", 8, 4, 4, 2, 2]])
    torch.manual_seed(0)
    model = transformers.LevitModel(config)
    with torch.no_grad():  # weights and statistics that give outputs of order 0.1 (the defaults give 1e-10)
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, parameter[0].numel() ** -0.5)
        for _ in range(3):
            model.train()(torch.randn(4, 3, 64, 64))
    return model.eval(), lambda batch: torch.randn(batch, 3, 64, 64)


MODELS = {
    "bias_cache": lambda: (BiasCache().eval(), lambda batch: torch.randn(batch, 8)),
    "stows_then_breaks": lambda: (StowsThenBreaks().eval(), lambda batch: torch.randn(batch, 4)),
    "swinv2": _swinv2,
    "levit": small_levit,
}


@pytest.mark.parametrize("method", ["auto", "fx", "export"])
@pytest.mark.parametrize("name", list(MODELS))
def test_capturing_twice_leaves_the_model_as_it_was(name, method):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    with torch.no_grad():
        model(inputs(2))  # the caches a call fills, as eager fills them
    before = _state(model)
    for batch in (2, 3):
        try:
            captured = fxforge.capture(model, (inputs(batch),), method=method)
        except fxforge.CaptureError:
            captured = None  # (a method that cannot capture the model: it must leave it as it was all the same)
        assert _state(model) == before, f"capture {batch} with {method} left something on {name}"
        _no_stand_ins(model)
        if captured is not None:
            x = inputs(batch)
            with torch.no_grad():
                assert compare_outputs(model(x), captured.graph_module(x)).ok


@pytest.mark.parametrize("name", list(MODELS))
def test_optimize_runs_the_graph_not_eagerly(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    opt = fxforge.optimize(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # "its forward sets ... on every call" fails
        for batch in (2, 3, 2):
            x = inputs(batch)
            with torch.no_grad():
                assert compare_outputs(model(x), opt(x)).ok
    assert opt.report.method != "eager", opt.report.notes
    assert not [note for note in opt.cache.notes if "forward set" in note], opt.cache.notes
    _no_stand_ins(model)


def test_a_failed_trace_leaves_no_stowed_constant():
    model = StowsThenBreaks().eval()
    before = set(vars(model))
    with pytest.raises(fxforge.CaptureError):
        fxforge.capture(model, (torch.randn(2, 4),), method="export")  # the branch on data: no graph
    captured = fxforge.capture(model, (torch.randn(2, 4),), method="fx")  # the gate kept opaque
    assert [o.name for o in captured.report.opaque] == ["gate"]
    assert set(vars(model)) == before


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_cold_cache_is_not_filled_with_stand_ins(method):
    model = BiasCache().eval()  # no eager call yet: the trace is the first to reach the cache
    captured = fxforge.capture(model, (torch.randn(2, 8),), method=method, check=False)
    assert model.cache == {}
    x = torch.randn(3, 8) if method == "fx" else torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(captured.graph_module(x), model(x))
    assert list(model.cache) == ["cpu"] and not isinstance(model.cache["cpu"], torch._subclasses.FakeTensor)
