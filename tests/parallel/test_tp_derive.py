"""The tensor-parallel plan derived from the graph: the styles per layer, the reasons, the attribute edits.

LLaMA's plan is held to torchtitan's hand-written ``apply_tp`` (torchtitan/models/llama3/infra/parallelize.py),
written out below as the oracle with transformers' names for torchtitan's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxforge.parallel.tp_derive import STYLES, derive_tp_plan, tied_parameters
from tests.parallel.tp_models import MLP, Attention, NormBetween, transformers_model

pytest.importorskip("transformers")

# torchtitan's apply_tp for Llama 3, per transformer block and for the model, in transformers' names:
# tok_embeddings RowwiseParallel(input Replicate, output Shard(1)) -> split over the vocabulary; output
# ColwiseParallel(input Shard(1)) -> the LM head over the vocabulary; wq/wk/wv ColwiseParallel, wo
# RowwiseParallel(output Shard(1)); w1 (gate) / w3 (up) ColwiseParallel, w2 (down) RowwiseParallel(output
# Shard(1)); attention_norm, ffn_norm, norm SequenceParallel.
TORCHTITAN_LLAMA = {
    "model.embed_tokens": "vocab",              # tok_embeddings
    "lm_head": "vocab",                         # output
    "model.norm": "sequence",                   # norm
    **{f"model.layers.{i}.{name}": style for i in range(2) for name, style in {
        "self_attn.q_proj": "colwise",          # attention.wq
        "self_attn.k_proj": "colwise",          # attention.wk
        "self_attn.v_proj": "colwise",          # attention.wv
        "self_attn.o_proj": "rowwise",          # attention.wo
        "mlp.gate_proj": "colwise",             # feed_forward.w1
        "mlp.up_proj": "colwise",               # feed_forward.w3
        "mlp.down_proj": "rowwise",             # feed_forward.w2
        "input_layernorm": "sequence",          # attention_norm
        "post_attention_layernorm": "sequence",  # ffn_norm
    }.items()},
}


def _plan(name: str, degree: int = 2, **kwargs):
    model, inputs = transformers_model(name, **kwargs)
    return model, derive_tp_plan(model, inputs, degree)


def test_llama_places_every_layer_as_torchtitan():
    model, plan = _plan("llama")
    linears = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    assert linears <= set(TORCHTITAN_LLAMA)
    assert {name: plan.styles[name] for name in TORCHTITAN_LLAMA} == TORCHTITAN_LLAMA
    assert plan.sequence_parallel and plan.split_outputs == ["model.embed_tokens"]
    # one gather per attention and per MLP (torchtitan's PrepareModuleInput on attention and feed_forward)
    assert set(plan.gathers) == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")}
    assert plan.edits == {}  # transformers' views use -1 for the head count: nothing to divide


def test_gpt2_replicates_the_fused_qkv_projection_and_splits_the_mlp():
    _, plan = _plan("gpt2")
    for i in range(2):
        assert plan.styles[f"transformer.h.{i}.attn.c_attn"] == "replicate"
        assert "fused projection split into q, k, v" in plan.reasons[f"transformer.h.{i}.attn.c_attn"]
        assert f"transformer.h.{i}.attn.c_attn (kept whole)" in plan.reasons[f"transformer.h.{i}.attn.c_proj"]
        assert plan.styles[f"transformer.h.{i}.mlp.c_fc"] == "colwise"    # Conv1D: a transposed linear
        assert plan.styles[f"transformer.h.{i}.mlp.c_proj"] == "rowwise"
        assert plan.styles[f"transformer.h.{i}.ln_1"] == plan.styles[f"transformer.h.{i}.ln_2"] == "sequence"
    assert plan.kinds["transformer.h.0.mlp.c_fc"] == "transposed_linear"
    assert plan.styles["transformer.wte"] == plan.styles["lm_head"] == "vocab"          # tied: one placement
    assert ("transformer.wte.weight", "lm_head.weight") in plan.tied
    assert "not by its input tokens" in plan.reasons["transformer.wpe"]
    # The replicated attention leaves the sequence split at ln_1 and rejoins it after its dropout.
    assert plan.sequence_parallel and "transformer.h.0.ln_1" in plan.exits
    assert "transformer.h.0.attn.resid_dropout" in plan.entries


def test_bert_post_ln_norms_are_sequence_parallel():
    _, plan = _plan("bert")
    for i in range(2):
        p = f"encoder.layer.{i}."
        assert [plan.styles[p + f"attention.self.{x}"] for x in ("query", "key", "value")] == ["colwise"] * 3
        assert plan.styles[p + "attention.output.dense"] == "rowwise"
        assert plan.styles[p + "intermediate.dense"] == "colwise" and plan.styles[p + "output.dense"] == "rowwise"
        # post-LN: the LayerNorm after the residual add of a row-parallel output is on the sequence-split stream
        assert plan.styles[p + "attention.output.LayerNorm"] == plan.styles[p + "output.LayerNorm"] == "sequence"
        assert plan.edits[p + "attention.self"] == {"num_attention_heads": (4, 2), "all_head_size": (64, 32)}
    assert plan.styles["embeddings.word_embeddings"] == "vocab"
    assert plan.styles["embeddings.LayerNorm"] == "replicate"      # normalizes the sum of replicated lookups
    assert plan.styles["pooler.dense"] == "replicate" and "returned by the model" in plan.reasons["pooler.dense"]
    assert plan.exits == ["encoder.layer.1.output.LayerNorm"]     # the pooler reads the first token whole


def test_t5_splits_the_relative_position_bias_by_heads():
    _, plan = _plan("t5")
    for stack, layers in (("encoder", ("SelfAttention",)), ("decoder", ("SelfAttention", "EncDecAttention"))):
        for i in range(2):
            for j, attention in enumerate(layers):
                p = f"{stack}.block.{i}.layer.{j}.{attention}."
                assert [plan.styles[p + x] for x in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
            ff = f"{stack}.block.{i}.layer.{len(layers)}.DenseReluDense."
            assert (plan.styles[ff + "wi"], plan.styles[ff + "wo"]) == ("colwise", "rowwise")
        # the [buckets, heads] bias embedding: each rank keeps its heads' columns
        assert plan.styles[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"] == "colwise"
    # zeros(1, n_heads, ...) for the cross-attention's bias: n_heads is divided on each rank
    assert plan.edits["decoder.block.0.layer.1.EncDecAttention"]["n_heads"] == (4, 2)
    assert {plan.styles[n] for n in ("shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head")} == {"vocab"}
    assert not plan.sequence_parallel and "gather it back" in plan.sequence_reason


def test_vit_splits_attention_and_mlp():
    _, plan = _plan("vit")
    for i in range(2):
        p = f"layers.{i}."
        assert [plan.styles[p + f"attention.{x}_proj"] for x in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
        assert (plan.styles[p + "mlp.fc1"], plan.styles[p + "mlp.fc2"]) == ("colwise", "rowwise")
        assert plan.styles[p + "layernorm_before"] == plan.styles[p + "layernorm_after"] == "sequence"
    assert "Conv2d" in plan.reasons["embeddings.patch_embeddings.projection"]
    assert plan.sequence_parallel
    _, plan4 = _plan("vit", degree=4)
    assert not plan4.sequence_parallel and plan4.sequence_reason == "the sequence of 10 does not divide by the degree 4"


def test_user_mlp_pairs_consecutive_layers():
    plan = derive_tp_plan(MLP(), (torch.randn(4, 16),), 2)
    assert plan.styles == {"fc1": "colwise", "fc2": "rowwise", "fc3": "colwise", "fc4": "rowwise"}
    assert not plan.sequence_parallel and "no common sequence dimension" in plan.sequence_reason


def test_user_attention_block_divides_its_head_count():
    model = nn.Sequential(Attention(), Attention(), nn.LayerNorm(32))
    plan = derive_tp_plan(model, (torch.randn(2, 6, 32),), 2)
    for i in range(2):
        assert [plan.styles[f"{i}.{x}"] for x in ("query", "key", "value", "out")] == ["colwise"] * 3 + ["rowwise"]
        assert plan.edits[str(i)] == {"num_heads": (4, 2)}   # the view by self.num_heads
        assert plan.styles[f"{i}.norm"] == "sequence"
    # q, k and v read the norm's output: gathered once there, not once per layer
    assert plan.gather_outputs == ["0.norm", "1.norm"] and plan.seq_inputs == ["0.norm", "1.norm"]
    assert plan.sequence_parallel and plan.exits == ["2"] and plan.entry_inputs == {"0": (0, 1)}


def test_a_norm_between_two_linear_layers_is_no_pair():
    plan = derive_tp_plan(NormBetween(), (torch.randn(4, 16),), 2)
    assert plan.styles == {"up": "replicate", "norm": "replicate", "down": "replicate"}
    assert plan.reasons["up"] == "norm: layer_norm over the split dimension of (4, 32)"
    assert "not row-parallel: its input comes from up (kept whole)" in plan.reasons["down"]


def test_heads_the_degree_does_not_divide_keep_the_attention_whole():
    plan = derive_tp_plan(Attention(dim=48, num_heads=3), (torch.randn(2, 6, 48),), 2)
    for name in ("query", "key", "value"):
        assert plan.styles[name] == "replicate"
        assert plan.reasons[name] == ("the model: views (2, 6, 48) as (2, 6, 3, 16): 3 heads are not divisible by the degree 2 "
                                      "(a rank would get part of a head)")
    _, gqa = _plan("llama", degree=4)  # 2 KV heads over 4 ranks
    reason = gqa.reasons["model.layers.0.self_attn.k_proj"]
    assert "2 heads are not divisible by the degree 4" in reason
    assert gqa.reasons["model.layers.0.self_attn.q_proj"] == reason   # q, k, v go together
    assert gqa.styles["model.layers.0.mlp.gate_proj"] == "colwise"


def test_plan_text_and_vocabulary():
    plan = derive_tp_plan(NormBetween(), (torch.randn(4, 16),), 2)
    assert set(plan.styles.values()) <= set(STYLES)
    assert all(plan.reasons[name] for name in plan.of_style("replicate"))
    text = str(plan)
    assert text.startswith("tensor parallel, degree 2, sequence parallel: no") and "up: replicate" in text
    with pytest.raises(ValueError, match="at least 2"):
        derive_tp_plan(NormBetween(), (torch.randn(4, 16),), 1)


def test_tied_parameters_and_sequence_parallel_off():
    model, inputs = transformers_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = derive_tp_plan(model, inputs, 2, sequence_parallel=False)
    # the model is left as it was: no hook of the trace's, same weights, same mode
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()) and not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not plan.sequence_parallel and not plan.of_style("sequence") and plan.sequence_reason == ""
    assert plan.styles["model.layers.0.input_layernorm"] == "replicate"
    assert tied_parameters(model) == []
