"""The fusions PyTorch Inductor's oneDNN pattern matcher makes on CPU in float32, re-written in our own words.

Inductor's own tests (``test/inductor/test_mkldnn_pattern_matcher.py``) check that a convolution (1d-3d), a
transposed convolution or a linear layer followed by each unary op, and by an add or subtraction of another
tensor (with an activation after it), becomes one fused oneDNN call. Here each such form, in each call form
users write (``nn`` modules, ``F.*``, Tensor methods, operators, in-place ops), with contiguous and channels-last
inputs, goes through ``fxforge.rewrite`` with the tuner held to oneDNN and to the fused graph
(``TuningPolicy(kernel="mkldnn", keep="fused")``), and must be

- fused (a ``conv_activation`` or ``binary_fold`` application), or refused with a reason in the report, at most
  5 % of the forms refused;
- equal to eager on fresh inputs (0 wrong answers);
- free of exceptions inside fxforge (no pass rolled back because it raised).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fxforge
from fxforge.lowering.autotune import TuningPolicy

F = nn.functional
POLICY = TuningPolicy(kernel="mkldnn", keep="fused")
FUSING = ("conv_activation", "binary_fold")
REWRITES = ["conv_bn_fold", "binary_fold", "conv_activation"]  # (the default list's fusing passes)

# unary op -> (module form, functional form): Inductor's unary fusion list
UNARY: dict[str, tuple[Callable[[], nn.Module], Callable]] = {
    "relu": (nn.ReLU, F.relu),
    "relu_": (lambda: nn.ReLU(inplace=True), lambda y: y.relu_()),
    "sigmoid": (nn.Sigmoid, torch.sigmoid),
    "tanh": (nn.Tanh, lambda y: y.tanh()),
    "hardswish": (nn.Hardswish, F.hardswish),
    "hardsigmoid": (nn.Hardsigmoid, F.hardsigmoid),
    "leaky_relu": (lambda: nn.LeakyReLU(0.1), lambda y: F.leaky_relu(y, 0.1)),
    "leaky_relu_where": (None, lambda y: torch.where(y > 0, y, y * 0.1)),
    "hardtanh": (lambda: nn.Hardtanh(-0.5, 4.0), lambda y: F.hardtanh(y, -0.5, 4.0)),
    "relu6": (nn.ReLU6, F.relu6),
    "gelu": (nn.GELU, F.gelu),
    "gelu_tanh": (lambda: nn.GELU(approximate="tanh"), lambda y: F.gelu(y, approximate="tanh")),
    "silu": (nn.SiLU, F.silu),
}
# binary op -> how the user writes it (y: the layer's output, o: the other tensor)
BINARY: dict[str, Callable] = {
    "add": lambda y, o: y + o,
    "add_": lambda y, o: y.add_(o),
    "torch.add": lambda y, o: torch.add(o, y),
    "sub": lambda y, o: y - o,
    "sub_": lambda y, o: y.sub_(o),
}


class Layer(nn.Module):
    """One layer (``kind``: conv1d/2d/3d, conv_transpose2d/3d, linear), then ``after(y, *rest)``."""

    def __init__(self, kind: str, after: Callable | nn.Module, module_form: bool):
        super().__init__()
        dims = int(kind[-2]) if kind != "linear" else 0
        if kind == "linear":
            self.layer = nn.Linear(16, 16)
        elif kind.startswith("conv_transpose"):
            self.layer = [nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d][dims - 1](4, 8, 3, stride=2)
        else:
            self.layer = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1](4, 8, 3, padding=1)
        self.kind, self.dims, self.module_form = kind, dims, module_form
        self.after = after

    def forward(self, x, *rest):
        if self.module_form or self.kind == "linear":
            y = self.layer(x)
        elif self.kind.startswith("conv_transpose"):
            y = getattr(F, f"conv_transpose{self.dims}d")(x, self.layer.weight, self.layer.bias, stride=2)
        else:
            y = getattr(F, f"conv{self.dims}d")(x, self.layer.weight, self.layer.bias, padding=1)
        return self.after(y, *rest)


@dataclasses.dataclass
class Case:
    name: str
    model: nn.Module
    inputs: tuple


def _input(kind: str, channels_last: bool) -> torch.Tensor:
    if kind == "linear":
        return torch.randn(6, 16)
    dims = int(kind[-2])
    x = torch.randn(2, 4, *[5 if dims == 3 else 8] * dims)
    if channels_last and dims in (2, 3):
        x = x.contiguous(memory_format=torch.channels_last if dims == 2 else torch.channels_last_3d)
    return x


def _output_shape(model: nn.Module, x: torch.Tensor) -> torch.Size:
    with torch.no_grad():
        return model.layer(x).shape


def unary_cases() -> list[Case]:
    cases = []
    for kind in ("conv1d", "conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d", "linear"):
        for unary, (module, function) in UNARY.items():
            for module_form in (True, False):
                if module_form and module is None:
                    continue
                after = module() if module_form else function
                # (channels-last inputs in the functional form only: the module form calls the same op)
                for channels_last in ((False, True) if kind not in ("conv1d", "linear") and not module_form else (False,)):
                    name = f"{kind}+{unary}{'[module]' if module_form else ''}{'[channels_last]' * channels_last}"
                    cases.append(Case(name, Layer(kind, after, module_form), (_input(kind, channels_last),)))
    return cases


def binary_cases() -> list[Case]:
    cases = []
    for kind in ("conv2d", "conv3d", "linear"):
        for binary, combine in BINARY.items():
            for then in (None, "relu", "sigmoid"):
                for broadcast in (False, True):
                    def after(y, o, combine=combine, then=then):
                        y = combine(y, o)
                        return y if then is None else getattr(torch, then)(y)

                    model = Layer(kind, after, module_form=True)
                    x = _input(kind, channels_last=broadcast)
                    shape = list(_output_shape(model, x))
                    if broadcast:  # a per-sample, per-channel gate (gcresnet, squeeze-excite), or a row for linear
                        shape = [shape[0], shape[1]] + [1] * (len(shape) - 2) if kind != "linear" else [shape[-1]]
                    name = f"{kind}+{binary}{'+' + then if then else ''}{'[broadcast]' if broadcast else ''}"
                    cases.append(Case(name, model, (x, torch.randn(shape))))
    return cases


def _fresh(inputs: tuple) -> tuple:
    return tuple(torch.empty_like(t, memory_format=torch.preserve_format).copy_(torch.randn(t.shape)) for t in inputs)


def check(case: Case) -> str:
    """"fused" or "refused: reason"; fails the test on a wrong answer or an exception inside fxforge."""
    model = case.model.eval()
    new = fxforge.rewrite(fxforge.capture(model, case.inputs), REWRITES, tuning=POLICY)
    raised = [r for r in new.report.rolled_back if "raise" in r.error]
    assert not raised, f"{case.name}: {raised}"
    for inputs in (case.inputs, _fresh(case.inputs)):
        with torch.no_grad():
            expected = model(*[t.clone() for t in inputs])
            got = new.graph_module(*[t.clone() for t in inputs])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{case.name}: {m}")
    if any(new.report.counts.get(name) for name in FUSING):
        return "fused"
    reasons = [m.reason for m in new.report.near_misses if m.rule in FUSING]
    reasons += [r.error for r in new.report.rolled_back if r.rule in FUSING]  # (a difference verification found)
    assert reasons, f"{case.name}: neither fused nor refused with a reason"
    return "refused: " + reasons[0]


@pytest.mark.parametrize("family", ["unary", "binary"])
def test_every_form_inductor_fuses_is_fused_or_refused_with_a_reason(family):
    cases = unary_cases() if family == "unary" else binary_cases()
    outcomes = {case.name: check(case) for case in cases}
    refused = {name: why for name, why in outcomes.items() if why != "fused"}
    assert len(refused) <= 0.05 * len(cases), refused
    print(f"{family}: {len(cases)} forms, {len(cases) - len(refused)} fused, {len(refused)} refused: {refused}")


def test_the_suite_covers_what_inductor_covers():
    # counts pinned so that a form dropped from the suite is noticed
    assert len(unary_cases()) == 4 * (25 + 13) + 2 * 25 and len(binary_cases()) == 3 * 5 * 3 * 2
