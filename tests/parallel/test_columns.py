"""A Linear layer heavier than a pipeline stage computed in column blocks (fxforge/parallel/columns.py):
the same outputs and gradients as the layer, on its own (tied) parameters, and a split that shares it
between stages, run on torch.distributed.pipelining."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import fxforge
from fxforge.parallel.columns import (
    ALIGN,
    ColumnBlocks,
    block_edges,
    column_plans,
    splittable_linear,
)
from fxforge.parallel.launch import run_pipeline
from fxforge.parallel.restructure import with_column_blocks
from fxforge.runtime.roofline import Machine
from tests.training import models

VOCAB = 8000


def big_vocab_gpt2() -> torch.nn.Module:
    """GPT-2 whose LM head (tied to the token embedding) is more than a mean stage of four. Hidden 256 and
    256 tokens a microbatch: with much less, a block's matrix multiply costs little more than adding up its
    gradient of the whole weight and concatenating the logits, and blocks do not pay."""
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()


def ids(seed: int, batch: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, 64), generator=torch.Generator().manual_seed(seed))


def test_blocks_give_the_layers_outputs_and_gradients_on_its_own_parameters():
    model = big_vocab_gpt2()
    blocked = with_column_blocks(model, {"lm_head": 5})
    # The model is left as it was; everything but the path to the layer is shared.
    assert type(model.lm_head) is torch.nn.Linear and isinstance(blocked.lm_head, ColumnBlocks)
    assert blocked.transformer is model.transformer
    assert all(b.weight is model.transformer.wte.weight for b in blocked.lm_head.blocks)   # still tied
    assert [b.stop - b.start for b in blocked.lm_head.blocks] == [1600, 1600, 1600, 1600, 1600]
    x = ids(seed=11)                                                  # fresh inputs
    grads = []
    for m in (model, blocked):
        model.zero_grad(set_to_none=True)
        out = m(input_ids=x).logits
        out.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        grads[-1]["logits"] = out.detach()
    for name, expected in grads[0].items():
        torch.testing.assert_close(grads[1][name], expected, rtol=1e-5, atol=1e-6, msg=name)


@settings(max_examples=60, deadline=None)
@given(features=st.integers(1, 5000), blocks=st.integers(1, 40))
def test_block_edges_cover_the_features_on_aligned_edges(features, blocks):
    edges = block_edges(features, blocks)
    assert edges[0] == 0 and edges[-1] == features
    assert all(a < b for a, b in itertools.pairwise(edges))
    assert len(edges) - 1 <= blocks and all(e % ALIGN == 0 for e in edges[:-1])
    sizes = [b - a for a, b in itertools.pairwise(edges[:-1])]     # the last block may be short
    assert not sizes or max(sizes) - min(sizes) <= ALIGN              # as equal as the alignment allows


def test_only_a_plain_linear_heavier_than_a_stage_is_planned():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4096))
    assert column_plans(model, ["", "1", "2"], [1.0, 0.1, 1.0], stages=2) == []     # 1.0 is not above the mean
    assert column_plans(model, ["", "1", "2"], [1.0, 0.1, 3.0], stages=2) == [{"2": 3}, {"2": 6}, {"2": 9}]
    assert column_plans(model, ["", "1", "2"], [1.0, 0.1, 3.0], stages=1) == []
    model[2].register_forward_hook(lambda *a: None)                   # a hook would not see the blocks
    assert splittable_linear(model, "2") is None and splittable_linear(model, "1") is None
    with pytest.raises(ValueError, match="'1' is not a Linear layer"):
        with_column_blocks(model, {"1": 2})


def test_partition_shares_the_lm_head_between_stages_and_gloo_runs_it():
    model = big_vocab_gpt2()
    batch = {"input_ids": ids(seed=0)}
    machine = Machine("cpu", 100.0, 20.0, "fixed")                   # the plan does not depend on the load
    plain = fxforge.partition(model, batch, 4, microbatches=4, column_blocks=False, machine=machine)
    part = fxforge.partition(model, batch, 4, microbatches=4, machine=machine)
    assert plain.column_blocks == {} and plain.floor_ratio > 1.3      # the LM head alone: 1.3 mean stages
    assert set(part.column_blocks) == {"lm_head"}
    assert part.bottleneck_ratio <= 1.10 < plain.bottleneck_ratio
    assert part.throughput["1F1B"] > plain.throughput["1F1B"]
    assert any(name.startswith("lm_head.blocks.") for name in part.split_points)     # a stage begins inside it
    assert "computed in" in str(part) and type(model.lm_head) is torch.nn.Linear
    assert part.pipe().num_stages == 4
    assert "forward" not in model.transformer.__dict__                # no split marker left on the model
    run = run_pipeline(part, {"input_ids": ids(seed=5)})              # the tied weight's copies add up
    assert run.ok, str(run)
    with pytest.raises(ValueError, match="traced on another model"):  # the blocked model's units
        fxforge.partition(model, batch, 4, microbatches=4, units=part.units, policy="even-layers")


def test_a_model_without_a_heavy_layer_is_planned_as_before():
    model = models.gpt2(dropout=0.0, layers=4).eval()
    part = fxforge.partition(model, {"input_ids": models.ids(batch=8)}, 2, microbatches=2)
    assert part.column_blocks == {} and part.pipeline_model is model
