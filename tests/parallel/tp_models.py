"""Tiny models for the tensor-parallel tests: transformers configs with random weights, and user-written ones.

Every transformers model has 4 attention heads, hidden size 64, 2 layers and a vocabulary of 128, dropout
off; ``kv_heads`` sets LLaMA's key/value heads (the degree must divide them for its attention to split).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fxforge.parallel.collectives import comparable
from fxforge.parallel.tp_build import predicted_tp_collectives
from fxforge.parallel.tp_derive import derive_tp_plan

SEQ = 8
TOLERANCE = 1e-12  # float64: outputs and gradients, relative to the largest value


def transformers_model(name: str, kv_heads: int = 2) -> tuple[nn.Module, object]:
    """(model in eval mode, example inputs) for one of llama, gpt2, bert, t5, vit."""
    import transformers as tf

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, SEQ))
    if name == "llama":
        config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                                use_cache=False)
        return tf.LlamaForCausalLM(config).eval(), (ids,)
    if name == "gpt2":
        config = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(config).eval(), (ids,)
    if name == "bert":
        config = tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
        return tf.BertModel(config).eval(), (ids,)
    if name == "t5":
        config = tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                             num_heads=4, dropout_rate=0.0, use_cache=False)
        return tf.T5ForConditionalGeneration(config).eval(), {"input_ids": ids, "decoder_input_ids": ids.flip(1)}
    if name == "vit":  # 12x12 images in 4x4 patches: 9 patches and the class token, a sequence of 10
        config = tf.ViTConfig(image_size=12, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
        return tf.ViTModel(config).eval(), (torch.randn(2, 3, 12, 12),)
    raise ValueError(name)


class MLP(nn.Module):
    """A user's MLP: four linear layers with activations between (two column/row pairs)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.fc3, self.fc4 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(torch.relu(self.fc1(x)))
        return self.fc4(torch.tanh(self.fc3(x)) * 2.0)


class Attention(nn.Module):
    """A user's attention block: its own head split by ``self.num_heads``, transposes and softmax."""

    def __init__(self, dim: int = 32, num_heads: int = 4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.query(h).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.key(h).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.value(h).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), dim=-1)
        mixed = (weights @ v).transpose(1, 2).reshape(b, s, -1)
        return x + self.out(mixed)


class NormBetween(nn.Module):
    """Two linear layers with a LayerNorm between: no column/row pair (the norm needs all features)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(width, 2 * width), nn.LayerNorm(2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


def _leaves(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _leaves(item)]
    return []


def _call(model: nn.Module, inputs: object) -> list[torch.Tensor]:
    return _leaves(model(**inputs) if isinstance(inputs, dict) else model(*inputs))


def _per_rank(value: torch.Tensor, degree: int) -> list[torch.Tensor]:
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, LocalTensor):
        return [value._local_tensors[r] for r in range(degree)]
    return [value] * degree


def run_tp(model: nn.Module, inputs: object, plan, degree: int):
    """Build ``plan`` on a copy of ``model`` (float64) and run one forward and backward on every simulated rank
    (``LocalTensorMode``, one process, over the fake process group the caller set up), counting collectives.

    Returns:
        (largest output error, largest gradient error, both relative to the largest value, and the counted
        collectives).
    """
    import copy

    from torch.distributed._local_tensor import LocalTensorMode

    from fxforge.parallel.collectives import CollectiveCounter
    from fxforge.parallel.tp_build import apply_tp, tp_mesh

    reference = copy.deepcopy(model).double()
    parallel = copy.deepcopy(reference)
    if not isinstance(inputs, dict):
        inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    expected = _call(reference, inputs)
    sum((t ** 2).sum() for t in expected).backward()
    mesh = tp_mesh(degree)
    with LocalTensorMode(degree):
        apply_tp(parallel, plan, mesh)
        with CollectiveCounter(mesh) as counter:
            actual = _call(parallel, inputs)
            sum((t ** 2).sum() for t in actual).backward()
        torch.set_grad_enabled(False)
        out_error = max(float((a - e).abs().max() / e.abs().max().clamp(min=1))
                        for got, e in zip(actual, expected) for a in _per_rank(got, degree))
        grads = dict(reference.named_parameters())
        grad_error = max(float((g - grads[name].grad).abs().max() / grads[name].grad.abs().max().clamp(min=1))
                         for name, p in parallel.named_parameters() for g in _per_rank(p.grad, degree))
        torch.set_grad_enabled(True)
    assert len(actual) == len(expected)
    return out_error, grad_error, counter.collectives


def check(model: nn.Module, inputs, degree: int, **kwargs):
    """Derive, build and run ``model``'s plan at ``degree``: outputs and gradients equal one process in float64,
    the collectives counted equal those predicted. Returns (plan, counted collectives)."""
    model = model.double()  # the bytes predicted are those of the model as it runs: float64 here
    if not isinstance(inputs, dict):
        inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    plan = derive_tp_plan(model, inputs, degree, **kwargs)
    out_error, grad_error, counted = run_tp(model, inputs, plan, degree)
    predicted = predicted_tp_collectives(model, inputs, plan)
    assert out_error <= TOLERANCE and grad_error <= TOLERANCE, (out_error, grad_error)
    assert comparable(counted) == comparable(predicted)
    assert sum(c.nbytes for c in counted) == sum(c.nbytes for c in predicted) > 0
    return plan, counted
