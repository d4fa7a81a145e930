"""BERT, T5 and ViT built from their derived tensor-parallel plans (see ``test_tp_build.py``): outputs and
gradients equal one process in float64, collectives counted equal those predicted.

BERT and T5 at degree 4 only: the same derivation and build as at 2, with one head per rank and four shards
whose offsets a rank-indexing slip at 2 would not show (degree 2 runs for LLaMA, GPT-2 and the user models in
``test_tp_build.py``, and here for ViT, whose sequence parallelism differs between 2 and 4)."""

from __future__ import annotations

import pytest

from tests.parallel.tp_models import check, transformers_model


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_bert(fake_world):
    model, inputs = transformers_model("bert")
    plan, _ = check(model, inputs, fake_world)
    assert plan.sequence_parallel and plan.exits == ["encoder.layer.1.output.LayerNorm"]


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_t5(fake_world):
    model, inputs = transformers_model("t5")
    plan, _ = check(model, inputs, fake_world)
    assert plan.edits["decoder.block.0.layer.1.EncDecAttention"]["n_heads"] == (4, 4 // fake_world)
    assert "decoder" in plan.gathers  # the encoder's output read by every cross-attention: one gather


@pytest.mark.parametrize("fake_world", [2, 4], indirect=True)
def test_vit(fake_world):
    model, inputs = transformers_model("vit")
    plan, _ = check(model, inputs, fake_world)
    assert plan.sequence_parallel == (fake_world == 2)   # a sequence of 10 splits in 2, not in 4
