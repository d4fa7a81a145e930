"""Small real models for the training tests: transformers configs with random weights, seeded."""

from __future__ import annotations

import torch
import transformers

transformers.logging.set_verbosity_error()

BATCH, SEQ, VOCAB = 4, 64, 500


def ids(seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def images(seed: int = 0, batch: int = BATCH, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def gpt2(dropout: float = 0.1, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=256, use_cache=False,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)).train()


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
        vocab_size=VOCAB)).train()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, use_cache=False)).train()


def resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.ResNetModel(transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1])).train()
    with torch.no_grad():  # batch-norm statistics from a few train-mode passes, not random-init ones
        for seed in range(3):
            model(images(seed))
    return model


def conv_bn(layers: int = 4, width: int = 16, activation: type = torch.nn.ReLU) -> torch.nn.Module:
    """A plain stack of 3 x 3 convolutions, each after a batch norm and an activation (from 3 input channels)."""
    torch.manual_seed(0)
    blocks = [torch.nn.Conv2d(3, width, 3, padding=1)]
    for _ in range(layers):
        blocks += [torch.nn.BatchNorm2d(width), activation(), torch.nn.Conv2d(width, width, 3, padding=1)]
    return torch.nn.Sequential(*blocks).train()


def vit(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.ViTModel(transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128, image_size=32,
        patch_size=8)).train()


MODELS = {"gpt2": (gpt2, ids), "bert": (bert, ids), "llama": (llama, ids), "resnet": (resnet, images),
          "vit": (vit, images)}
