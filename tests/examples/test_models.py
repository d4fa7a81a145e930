"""The example user models run, trace with torch.fx, export with torch.export, and train."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from examples.models import EXAMPLES, SmallUNet, TransformerEncoder
from examples.models import transformer_encoder as te

NAMES = sorted(EXAMPLES)

# Variants the registry does not cover: the other branch of each constructor flag.
VARIANTS = {
    "unet_bilinear": lambda: (SmallUNet(base=8, bilinear=True).eval(), (torch.randn(2, 3, 32, 32),)),
    "transformer_separate_qkv": lambda: (TransformerEncoder(fused_qkv=False).eval(), te.example()[1]),
    "transformer_fused_qkv": lambda: (TransformerEncoder(fused_qkv=True).eval(), te.example()[1]),
    "transformer_no_mask": lambda: (TransformerEncoder().eval(), te.example()[1][:1]),
}
ALL = {**EXAMPLES, **VARIANTS}

# symbolic_trace turns every forward argument into a placeholder, so an optional argument left out
# must be given to the tracer as a concrete None (otherwise the traced graph takes the mask path).
CONCRETE_ARGS = {"transformer_no_mask": {"attention_mask": None}}

EXPECTED_SHAPES = {
    "resnet_cnn": (2, 10),
    "densenet": (2, 10),
    "inception": (2, 10),
    "unet": (2, 2, 64, 64),
    "transformer_encoder": (2, 16, 64),
}


@pytest.mark.parametrize("name", NAMES)
def test_eval_forward_shape_and_finite(name):
    model, inputs = EXAMPLES[name]()
    assert not model.training, "factories return the model in eval mode"
    with torch.no_grad():
        out = model(*inputs)
    assert out.shape == EXPECTED_SHAPES[name]
    assert torch.isfinite(out).all()


def test_factories_are_deterministic():
    for name in NAMES:
        (m1, in1), (m2, in2) = EXAMPLES[name](), EXAMPLES[name]()
        assert all(torch.equal(a, b) for a, b in zip(in1, in2, strict=True)), name
        for (k, a), b in zip(m1.state_dict().items(), m2.state_dict().values(), strict=True):
            assert torch.equal(a, b), f"{name}: {k}"


@pytest.mark.parametrize("name", sorted(ALL))
def test_symbolic_trace_matches_eager(name):
    model, inputs = ALL[name]()
    gm = torch.fx.symbolic_trace(model, concrete_args=CONCRETE_ARGS.get(name))
    with torch.no_grad():
        expected = model(*inputs)
        got = gm(*inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(ALL))
def test_export_matches_eager(name):
    model, inputs = ALL[name]()
    ep = torch.export.export(model, inputs, strict=False)
    with torch.no_grad():
        expected = model(*inputs)
        got = ep.module()(*inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_train_backward_reaches_every_parameter(name):
    model, inputs = EXAMPLES[name]()
    model.train()
    out = model(*inputs)
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"
