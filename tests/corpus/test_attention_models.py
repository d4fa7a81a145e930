"""The attention rewrite on real models (issue 4, item 3): one replacement per attention layer.

For every transformers architecture the issue names (tiny configs, random weights, eager attention; see
``models.py``) the model is captured (``method="auto"``) and rewritten with ``rewrites=["attention"]``:

- ``report.counts["attention"]`` is the number of attention layers, computed from the config
  (:data:`ATTENTION_LAYERS`); the pass is not rolled back and reports no near miss;
- no softmax is left in the rewritten graph (in these models every softmax is an attention's), and there
  is one ``scaled_dot_product_attention`` per layer;
- in eval mode the outputs equal eager's;
- in training mode, built with every dropout probability 0 (so that nothing is random), the outputs and
  the gradients of every parameter equal eager's.

"One replacement per attention layer" means one per attention computation the forward runs, i.e. one per
attention module: a T5 encoder block has one (self-attention), a T5 decoder block two (causal
self-attention, and cross-attention over the encoder's output); Swin and Segformer have one per block of
every stage. :func:`test_expected_count_is_what_eager_runs` checks each formula against the model itself:
eager runs exactly that many softmaxes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from models import TRANSFORMERS, dropout_off
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fxforge
from fxforge.core.verify import compare_outputs, isolated

pytestmark = pytest.mark.slow

RULE = "attention"

# model -> number of attention layers, from its config (the config's own field names).
ATTENTION_LAYERS: dict[str, Callable[[object], int]] = {
    "bert": lambda c: c.num_hidden_layers,
    "distilbert": lambda c: c.n_layers,
    "roberta": lambda c: c.num_hidden_layers,
    "gpt2": lambda c: c.n_layer,
    "gpt_neo": lambda c: len(c.attention_layers),  # global and local layers alike
    "opt": lambda c: c.num_hidden_layers,
    "llama": lambda c: c.num_hidden_layers,
    "mistral": lambda c: c.num_hidden_layers,
    "qwen2": lambda c: c.num_hidden_layers,  # full and sliding-window layers alike
    "phi": lambda c: c.num_hidden_layers,
    "t5": lambda c: c.num_layers + 2 * c.num_decoder_layers,  # encoder self; decoder self + cross
    "t5_encoder": lambda c: c.num_layers,
    "vit": lambda c: c.num_hidden_layers,
    "deit": lambda c: c.num_hidden_layers,
    "swin": lambda c: sum(c.depths),
    "segformer": lambda c: sum(c.depths),
}
MODELS = sorted(ATTENTION_LAYERS)


def expected_count(model: torch.nn.Module, name: str) -> int:
    return ATTENTION_LAYERS[name](model.config)


def _call(fn, inputs: dict):
    return fn(**inputs)


def _loss(output) -> torch.Tensor:
    """A scalar from every floating-point output, with fixed random weights (so no gradient cancels)."""
    gen = torch.Generator().manual_seed(7)
    total = torch.zeros(())
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad:
            total = total + (leaf * torch.randn(leaf.shape, generator=gen, dtype=leaf.dtype)).sum()
    return total


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


class _CountSoftmax(TorchDispatchMode):
    """Counts the softmaxes a forward runs (below autograd, so every call form lands on ``aten._softmax``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._softmax:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def _rewritten(name: str, training: bool) -> tuple[torch.nn.Module, dict, fxforge.Captured]:
    """The model (in the mode asked), its inputs, and the graph after the attention rewrite, checked."""
    model, inputs = TRANSFORMERS[name]()
    model.train(training)
    cap = fxforge.capture(model, inputs, method="auto")
    new = fxforge.rewrite(cap, rewrites=[RULE])
    report = new.report
    mode = "train" if training else "eval"
    assert not [r for r in report.rolled_back if r.rule == RULE], f"{name} ({mode}): {report}"
    assert report.counts.get(RULE, 0) == expected_count(model, name), f"{name} ({mode}): {report}"
    near = [str(n) for n in report.near_misses if n.rule == RULE]
    assert not near, f"{name} ({mode}): near misses on a model where every attention is SDPA: {near}"
    targets = _targets(new.graph_module)
    assert not [t for t in targets if "softmax" in t], f"{name} ({mode}): a softmax is left: {targets}"
    sdpa = [t for t in targets if "scaled_dot_product" in t]
    assert len(sdpa) == expected_count(model, name), f"{name} ({mode}): {sdpa}"
    return model, inputs, new


def test_every_model_the_issue_names_is_here():
    issue = {"bert", "distilbert", "roberta", "gpt2", "gpt_neo", "opt", "llama", "mistral", "qwen2", "phi",
             "t5", "vit", "deit", "swin", "segformer"}
    assert issue <= set(ATTENTION_LAYERS) <= set(TRANSFORMERS)


@pytest.mark.parametrize("name", MODELS)
def test_expected_count_is_what_eager_runs(name):
    """The config formula is the model's: eager runs one softmax per attention layer, and no other."""
    model, inputs = TRANSFORMERS[name]()
    counter = _CountSoftmax()
    with torch.no_grad(), counter:
        _call(model, inputs)
    assert counter.count == expected_count(model, name) > 0


@pytest.mark.parametrize("name", MODELS)
def test_eval_outputs_equal_eager(name):
    model, inputs, new = _rewritten(name, training=False)
    with torch.no_grad():
        expected = _call(model, inputs)
        actual = _call(new.graph_module, inputs)
    result = compare_outputs(expected, actual)
    assert result.ok, f"{name}: {result.reason}"


@pytest.mark.parametrize("name", MODELS)
def test_train_outputs_and_gradients_equal_eager(name):
    with dropout_off():  # nothing random: eager and the graph must agree without sharing RNG draws
        model, inputs, new = _rewritten(name, training=True)
    assert new.training

    model.zero_grad(set_to_none=True)
    with isolated(model, seed=0):
        expected = _call(model, inputs)
        _loss(expected).backward()
    expected_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    with isolated(model, seed=0):
        actual = _call(new.graph_module, inputs)
        _loss(actual).backward()
    actual_grads = _grads(model)

    result = compare_outputs(expected, actual)
    assert result.ok, f"{name} train outputs: {result.reason}"
    with isolated(model, seed=1), torch.no_grad():  # nothing random is left: another seed, the same outputs
        assert compare_outputs(expected, _call(model, inputs)).max_abs_err == 0, f"{name}: dropout is live"
    unreached = [k for k, g in expected_grads.items() if g is None]
    assert not unreached, f"{name}: the loss does not reach {unreached}"
    grads = compare_outputs(expected_grads, actual_grads)
    assert grads.ok, f"{name} gradients: {grads.reason}"
