"""The model as torch.distributed.pipelining runs it (fxforge/parallel/restructure.py): torch.no_grad()
submodules as GradFree, shared parameters, the model left as it was. LLaMA, whose rotary embedding runs under
no_grad, split and run on gloo like the single process: test_launch.py (one launch for it and the user's loss)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import SplitPoint

from fxforge.parallel.engine import build_pipe
from fxforge.parallel.restructure import (
    GradFree,
    no_grad_forward,
    no_grad_modules,
    pipeline_ready,
    replace_submodules,
)


class Positions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.5))

    @torch.no_grad()
    def forward(self, x):
        return x.cumsum(-1) * self.scale, x.shape[-1]


class WithPositions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.positions = Positions()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        pos, _ = self.positions(x)
        return self.proj(x) + pos


def test_no_grad_submodules_run_as_grad_free_with_the_same_values_and_gradients():
    model = WithPositions()
    ready = pipeline_ready(model)
    assert no_grad_modules(model) == ["positions"] and no_grad_forward(model.proj) is None
    assert isinstance(ready.positions, GradFree) and ready.positions.inner is model.positions
    assert type(model.positions) is Positions and ready.proj is model.proj      # the model is left as it was
    x = torch.randn(3, 8, requires_grad=True)
    grads = []
    for m in (model, ready):
        x.grad = None
        model.zero_grad(set_to_none=True)
        out = m(x)
        out.square().sum().backward()
        grads.append((out.detach(), x.grad.clone(), model.proj.weight.grad.clone()))
    for got, expected in zip(grads[1], grads[0]):
        assert torch.equal(got, expected)
    with pytest.raises(TypeError, match="not decorated with torch.no_grad"):
        GradFree(torch.nn.ReLU())
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert pipeline_ready(plain) is plain                                        # nothing to replace


def test_replace_submodules_copies_only_the_paths():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()), torch.nn.Linear(2, 2))
    new = replace_submodules(model, {"0.0": torch.nn.GELU(), "0.1": torch.nn.SiLU()})
    assert [type(m).__name__ for m in new[0]] == ["GELU", "SiLU"]
    assert [type(m).__name__ for m in model[0]] == ["ReLU", "Tanh"]
    assert new[1] is model[1] and new[0] is not model[0]
    with pytest.raises(ValueError, match="'0.5' is not a submodule"):
        replace_submodules(model, {"0.5": torch.nn.GELU()})


def test_a_stage_sends_contiguous_tensors():
    class Transposing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x).transpose(1, 2))

    model = Transposing()
    x = torch.randn(2, 4, 6)
    pipe = build_pipe(model, ((x,), {}), {"b": SplitPoint.BEGINNING}, 2)
    sent = pipe.get_stage_module(0)(x)
    sent = sent[0] if isinstance(sent, tuple) else sent
    assert sent.is_contiguous() and sent.shape == (2, 6, 4)
    received = next(iter(pipe.get_stage_module(1).graph.find_nodes(op="placeholder")))
    assert received.meta["val"].is_contiguous()
