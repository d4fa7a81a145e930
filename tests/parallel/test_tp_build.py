"""Derived tensor-parallel plans built with DTensor: outputs and gradients equal the model in one process
(float64, every rank simulated in one process by ``LocalTensorMode``), and the collectives counted equal those
predicted from the graph, byte for byte.

LLaMA and GPT-2 here, BERT, T5 and ViT in ``test_tp_build_hf.py``; user-written models too. LLaMA runs at degrees 2
and 4 (its key/value heads follow the degree); GPT-2 and the user models at 4 only: the same derivation and build as
at 2, with one head per rank and four shards whose offsets a rank-indexing slip at 2 would not show.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from fxforge.parallel.tp_build import (
    Styles,
    TransposedColwiseParallel,
    TransposedRowwiseParallel,
    module_plan,
)
from fxforge.parallel.tp_derive import derive_tp_plan
from tests.parallel.tp_models import MLP, Attention, check, transformers_model


@pytest.mark.parametrize("fake_world", [2, 4], indirect=True)
def test_llama(fake_world):
    model, inputs = transformers_model("llama", kv_heads=fake_world)
    plan, counted = check(model, inputs, fake_world)
    assert plan.sequence_parallel and len(plan.of_style("colwise")) == 10
    # torchtitan's collectives: embedding and each block's two row-parallel layers reduce-scatter, each block
    # gathers its attention's and its MLP's input, the LM head gathers its input and its logits
    forward = [(c.kind, c.nbytes) for c in counted if c.phase == "forward"]
    hidden, logits = 2 * 8 * 64 * 8, 2 * 8 * 128 * 8
    assert sorted(forward) == sorted([("reduce_scatter", hidden)] * 5 + [("all_gather", hidden)] * 5
                                     + [("all_gather", logits)])


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_llama_without_sequence_parallel(fake_world):
    model, inputs = transformers_model("llama")
    plan, counted = check(model, inputs, fake_world, sequence_parallel=False)
    assert not plan.sequence_parallel
    assert {c.kind for c in counted} == {"all_reduce", "all_gather"}


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_gpt2_tied_embeddings(fake_world):
    model, inputs = transformers_model("gpt2")
    plan, _ = check(model, inputs, fake_world)
    assert plan.styles["lm_head"] == plan.styles["transformer.wte"] == "vocab"


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_user_models(fake_world):
    check(MLP(), (torch.randn(4, 16),), fake_world)
    plan, _ = check(nn.Sequential(Attention(), Attention(), nn.LayerNorm(32)), (torch.randn(2, 8, 32),), fake_world)
    assert plan.edits["0"] == {"num_heads": (4, 4 // fake_world)} and plan.sequence_parallel


def test_llama_module_plan_is_torchtitans():
    """The styles and layouts torchtitan's apply_tp writes by hand (loss_parallel off), derived."""
    model, inputs = transformers_model("llama")
    styles = module_plan(derive_tp_plan(model, inputs, 2))
    embed, head = styles["model.embed_tokens"], styles["lm_head"]
    assert isinstance(embed, RowwiseParallel) and (embed.input_layouts, embed.output_layouts) == ((Replicate(),), (Shard(1),))
    assert isinstance(head, ColwiseParallel) and (head.input_layouts, head.output_layouts) == ((Shard(1),), (Replicate(),))
    assert isinstance(styles["model.norm"], SequenceParallel)
    for i in range(2):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert isinstance(styles[p + name], ColwiseParallel) and styles[p + name].input_layouts == (Replicate(),)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert isinstance(styles[p + name], RowwiseParallel) and styles[p + name].output_layouts == (Shard(1),)
        assert isinstance(styles[p + "input_layernorm"], SequenceParallel)
        attention, mlp = styles[p + "self_attn"], styles[p + "mlp"]
        assert isinstance(attention, PrepareModuleInput) and isinstance(mlp, PrepareModuleInput)
        assert attention.input_kwarg_layouts == {"hidden_states": Shard(1)}
        assert attention.desired_input_kwarg_layouts == {"hidden_states": Replicate()}
        assert (mlp.input_layouts, mlp.desired_input_layouts) == ((Shard(1),), (Replicate(),))


def test_gpt2_module_plan_uses_transposed_styles():
    model, inputs = transformers_model("gpt2")
    styles = module_plan(derive_tp_plan(model, inputs, 2))
    assert type(styles["transformer.h.0.mlp.c_fc"]) is TransposedColwiseParallel
    assert type(styles["transformer.h.0.mlp.c_proj"]) is TransposedRowwiseParallel
    assert isinstance(styles["transformer.h.0.ln_1"], Styles)  # sequence-parallel, then gathered for attention
    assert "transformer.h.0.attn.c_attn" not in styles
