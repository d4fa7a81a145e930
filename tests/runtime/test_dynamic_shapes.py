"""Dynamic shapes: one plan serves every size of a dim that changed, checked against eager on fresh inputs.

Models optimized on one example are called at other batch sizes and lengths (padded masks, causal
decoders, grouped kv heads, a fused convolution); every output must equal eager's, and the number of
captures must grow with the dims that became dynamic, not with the sizes seen.
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref

import pytest
import sympy
import torch
from torch import nn

import fxforge
from fxforge.core.symbolic import ShapeGuard
from fxforge.lowering.autotune import TuningPolicy
from fxforge.runtime.plans import FallbackWarning

transformers = pytest.importorskip("transformers")


def _text(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1 and length > 2:
        mask[-1, length // 2:] = 0  # the last row is padded
    return {"input_ids": ids, "attention_mask": mask}


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=128, attn_implementation="eager")
    return transformers.BertModel(config).eval()


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                     attn_implementation="eager")
    return transformers.GPT2Model(config).eval()


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                                      attn_implementation="eager")
    return transformers.LlamaModel(config).eval()


def _same_as_eager(model: nn.Module, opt: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    with torch.inference_mode():
        expected = model(**inputs)[0]
        got = opt(**inputs)[0]
    valid = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-4, atol=1e-5)


SIZES = [(2, 16), (2, 23), (3, 40), (4, 9), (1, 31), (5, 64), (3, 17)]


@pytest.mark.parametrize("factory", [_bert, _gpt2, _llama], ids=["bert", "gpt2", "llama"])
def test_token_inputs_get_one_plan_for_every_length_and_batch(factory):
    model = factory()
    opt = fxforge.optimize(model, _text(2, 16))
    # token inputs: the batch and sequence dims are dynamic from the first plan (every request has its own
    # length), the batch from 1; no call of the trace builds again, batches of one included
    assert opt.plans_built == 1 and opt.cache.last.shapes is not None
    for seed, (batch, length) in enumerate(SIZES[1:], 1):
        _same_as_eager(model, opt, _text(batch, length, seed))
    assert opt.plans_built == 1
    assert opt.report.counts.get("attention", 0) >= 2, opt.report
    shapes = opt.cache.last.shapes
    assert len(shapes.symbols) >= 2 and not shapes.assumptions
    assert any("checked against eager at" in note for note in opt.cache.notes)  # the first batch of one
    _same_as_eager(model, opt, _text(6, 50, 99))
    _same_as_eager(model, opt, _text(1, 70, 98))
    assert opt.plans_built == 1


def test_an_unpadded_decoder_without_a_mask_stays_causal_in_its_shape_generic_plan():
    # transformers builds a packed-sequence mask from the positions when no attention mask is given: read for
    # every length (one sequence), it is SDPA's is_causal, no S x S mask, as in a plan for one length
    model = _llama()
    opt = fxforge.optimize(model, (torch.randint(1, 100, (1, 24)),))
    assert opt.cache.last.shapes is not None
    sdpa = [n for n in opt.cache.last.captured.graph_module.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa and all(n.kwargs["is_causal"] and n.kwargs["attn_mask"] is None for n in sdpa)
    with torch.no_grad():
        for length in (5, 40):
            ids = torch.randint(1, 100, (1, length))
            torch.testing.assert_close(opt(ids)[0], model(ids)[0], rtol=1e-4, atol=1e-5)
        assert opt.plans_built == 1
        ids = torch.randint(1, 100, (1, 1))  # a sequence of one: served once checked against eager, no re-plan
        torch.testing.assert_close(opt(ids)[0], model(ids)[0], rtol=1e-4, atol=1e-5)
    assert opt.plans_built == 1
    assert any("checked against eager at" in note for note in opt.cache.notes)


def test_a_model_without_token_inputs_is_static_until_a_size_changes():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    opt = fxforge.optimize(model, (torch.randn(2, 5, 8),), method="export")
    assert opt.plans_built == 1 and opt.cache.last.shapes is None  # as torch.compile: the first plan is static
    with torch.no_grad():
        for shape in [(2, 9, 8), (2, 3, 8), (2, 40, 8)]:
            x = torch.randn(shape)
            torch.testing.assert_close(opt(x), model(x))
    assert opt.plans_built == 2 and opt.cache.last.shapes is not None


def test_a_torch_fx_plan_serves_new_sizes_after_a_check_instead_of_a_capture():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    opt = fxforge.optimize(model, (torch.randn(2, 5, 8),))
    with torch.no_grad():
        for shape in [(2, 9, 8), (2, 3, 8), (1, 40, 8), (2, 9, 8)]:
            x = torch.randn(shape)
            torch.testing.assert_close(opt(x), model(x))
    assert opt.plans_built == 1 and opt.cache.plans_reused == 3 and opt.cache.last.shapes is None


def test_a_decoder_returning_its_cache_is_shape_generic_from_the_first_plan():
    # GPT-2 returns a DynamicCache by default: torch.export needs it registered as a pytree, which the first
    # (dynamic) capture must do itself (a static capture used to have done it earlier in the process)
    from torch.utils import _pytree as pytree
    from transformers.cache_utils import DynamicCache
    if DynamicCache in pytree.SUPPORTED_NODES:
        pytree._deregister_pytree_node(DynamicCache)
    model = _gpt2()
    opt = fxforge.optimize(model, _text(2, 16), dynamic=True)
    for seed, (batch, length) in enumerate([(3, 40), (5, 9)], 1):
        _same_as_eager(model, opt, _text(batch, length, seed))
    assert opt.plans_built == 1 and opt.cache.last.shapes is not None


def test_retired_plans_are_freed_and_held_plans_are_bounded():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    opt = fxforge.optimize(model, (torch.randn(2, 8),), method="export")  # (a torch.fx plan would serve them all)
    static = weakref.ref(opt.cache.last)
    with torch.no_grad():
        for n in (3, 4, 5, 9):
            x = torch.randn(n, 8)
            torch.testing.assert_close(opt(x), model(x))
    gc.collect()
    assert static() is None  # the plan for batch 2 was retired when the shape-generic one took over
    assert opt.plans_built == 2 and len({id(p) for p in opt.cache.plans.values()}) == 1


def test_a_shape_generic_plan_is_built_on_the_smallest_earlier_inputs_that_fit():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    opt = fxforge.optimize(model, (torch.randn(2, 5, 8),), method="export")

    def built_on() -> list[str]:
        return [n for n in opt.report.notes if "built on an earlier call" in n]

    with torch.no_grad():
        x = torch.randn(6, 40, 8)  # both dims became dynamic: capture, checks and timing run at (2, 5, 8)
        torch.testing.assert_close(opt(x), model(x))
        assert len(built_on()) == 1 and "[2, 5, 8]" in built_on()[0] and "[6, 40, 8]" in built_on()[0]
        for shape in [(3, 7, 8), (9, 2, 8)]:  # served by that plan, at sizes no build saw
            x = torch.randn(shape)
            torch.testing.assert_close(opt(x), model(x))
        x = torch.randn(1, 30, 8)  # a batch of one: in the batch dim's range (from 1), served as well
        torch.testing.assert_close(opt(x), model(x))
    assert opt.plans_built == 2


class BranchesOnABatchOfOne(nn.Module):
    def forward(self, x):
        return x.sum(0) if x.shape[0] == 1 else x * 2  # a batch of one takes another path


def test_a_model_that_branches_on_a_batch_of_one_gets_a_plan_of_its_own_for_it():
    model = BranchesOnABatchOfOne()
    opt = fxforge.optimize(model, (torch.randn(2, 5),), method="export")
    with torch.no_grad():
        for shape in [(4, 5), (3, 5), (1, 5), (1, 5)]:
            x = torch.randn(shape)
            torch.testing.assert_close(opt(x), model(x))
    # static; shape-generic (its batch range includes 1, as torch.export allows, but the first batch of one is
    # checked against eager, differs, and is excluded); the batch of one's own plan
    assert opt.plans_built == 3
    assert any("differs from eager at" in note for note in opt.cache.notes), opt.cache.notes


def test_max_plans_then_eager_with_one_warning():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).eval()
    opt = fxforge.optimize(model, (torch.randn(2, 4),), dynamic=False, max_plans=3)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (3, 4, 5, 6, 7):
            x = torch.randn(n, 4)
            torch.testing.assert_close(opt(x), model(x))
    assert opt.plans_built == 3
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1 and "max_plans=3" in str(fallbacks[0].message)


def test_dynamic_false_keeps_one_plan_per_signature():
    model = nn.Linear(4, 2).eval()
    opt = fxforge.optimize(model, (torch.randn(2, 4),), dynamic=False)
    with torch.no_grad():
        for n in (3, 4):
            opt(torch.randn(n, 4))
    assert opt.plans_built == 3 and all(p.shapes is None for p in opt.cache.plans.values())


@pytest.mark.parametrize("factory", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_an_unpadded_decoder_is_proven_causal_for_every_length(factory):
    # without a padding mask the decoders' mask is kv_idx <= q_idx: in a shape-generic plan no constant computes
    # it, so it was passed to SDPA as a float S x S mask with the row fix; read as a formula it is causal for
    # every length (index_masks), and SDPA builds no mask
    model = factory()
    ids = {"input_ids": _text(2, 16)["input_ids"]}
    opt = fxforge.optimize(model, ids, dynamic=True)
    attention = [m.what for m in opt.report.matches if m.rule == "attention"]
    assert len(attention) == 2 and all("is_causal=True" in what and "attn_mask" not in what for what in attention)
    for seed, (batch, length) in enumerate([(3, 40), (5, 9), (2, 77)], 1):
        inputs = {"input_ids": _text(batch, length, seed)["input_ids"]}
        with torch.inference_mode():
            torch.testing.assert_close(opt(**inputs)[0], model(**inputs)[0], rtol=1e-4, atol=1e-5)
    assert opt.plans_built == 1


def test_dynamic_true_serves_every_size_from_the_first_plan():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.ReLU()).eval()
    # (the fusion kept whatever the timing: this test is about one plan serving every size)
    opt = fxforge.optimize(model, (torch.randn(2, 3, 16, 16),), dynamic=True, tuning=TuningPolicy(keep="fused"))
    with torch.no_grad():
        for shape in [(3, 3, 16, 16), (2, 3, 20, 12), (5, 3, 9, 31)]:
            x = torch.randn(shape)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    assert opt.plans_built == 1
    assert opt.report.counts.get("conv_activation") == 2


def test_explicit_dynamic_shapes_and_calls_outside_their_range():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU()).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    opt = fxforge.optimize(model, (torch.randn(2, 4),), dynamic_shapes={"input": {0: batch}})
    with torch.no_grad():
        for n in (1, 5, 8):
            x = torch.randn(n, 4)
            torch.testing.assert_close(opt(x), model(x))
        assert opt.plans_built == 1
        x = torch.randn(12, 4)  # outside [1, 8]: another plan, still eager's result
        torch.testing.assert_close(opt(x), model(x))
    assert opt.plans_built == 2


def test_changed_weights_reach_the_shape_generic_plan():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    opt = fxforge.optimize(model, (torch.randn(2, 4),), dynamic=True)
    with torch.no_grad():
        opt(torch.randn(3, 4))
        model[0].weight.mul_(-2)
        x = torch.randn(7, 4)
        torch.testing.assert_close(opt(x), model(x))
    assert opt.plans_built == 1


def test_shape_guard_checks_ranges_relations_strides_and_assumptions():
    s0, s1 = sympy.Symbol("s0"), sympy.Symbol("s1")
    guard = ShapeGuard([((s0, s1), (s1, 1)), ((s0, s1), (s1, 1)), None], {s0: (2, math.inf), s1: (2, 64)},
                       [sympy.Le(s0 * s1, 1000)])
    assert guard.check([torch.ones(3, 5), torch.ones(3, 5), 1]) is None
    assert "outside" in guard.check([torch.ones(3, 65), torch.ones(3, 65), 1])
    assert "elsewhere" in guard.check([torch.ones(3, 5), torch.ones(3, 6), 1])
    assert "strides" in guard.check([torch.ones(5, 3).t(), torch.ones(3, 5), 1])
    assert "assumed" in guard.check([torch.ones(40, 30), torch.ones(40, 30), 1])


class FixedRows(nn.Module):
    def forward(self, x):
        return x.reshape(2, -1).cumsum(1)  # two rows, whatever the batch: torch.export cannot keep it dynamic


def test_a_batch_dim_torch_export_refuses_to_range_from_one_falls_back_to_its_own_rule():
    from fxforge.capture.dynamic import capture_with_dims

    x = torch.randn(4, 6)
    captured = capture_with_dims(FixedRows(), (x,), {}, {(0, 0), (0, 1)})
    assert any("a batch of one needs a plan of its own" in note for note in captured.report.notes)
    for shape in [(4, 6), (4, 10)]:
        y = torch.randn(shape)
        torch.testing.assert_close(captured.graph_module(y), FixedRows()(y))
