"""Tiny real models for the capture corpus: transformers architectures built from configs, random weights.

Every factory returns ``(model, example_inputs)`` in eval mode, deterministic (fixed seed), small enough
that the whole corpus (eval and train) runs in a few minutes on two CPU cores. Text models take int64
``input_ids`` and, where the model has one, an ``attention_mask`` with some padding; vision models take
``pixel_values``. ``example_inputs`` is a dict of keyword inputs (the way these models are called).

Example:
    >>> model, inputs = TRANSFORMERS["bert"]()
    >>> sorted(inputs)
    ['attention_mask', 'input_ids']
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

SEED = 0
BATCH, SEQ, VOCAB = 2, 8, 128


def _text_inputs(with_mask: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + 1)
    inputs = {"input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen, dtype=torch.int64)}
    if with_mask:
        mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
        mask[1, -3:] = 0  # the second sequence is padded
        inputs["attention_mask"] = mask
    return inputs


def _image_inputs(size: int = 32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + 1)
    return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=gen)}


def _build(model_cls: type, config) -> nn.Module:
    torch.manual_seed(SEED)
    return model_cls(config).eval()


def bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    return _build(BertModel, config), _text_inputs()


def distilbert():
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                              max_position_embeddings=64, attn_implementation="eager")
    return _build(DistilBertModel, config), _text_inputs()


def gpt2():
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, attn_implementation="eager")
    return _build(GPT2Model, config), _text_inputs()


def opt():
    from transformers import OPTConfig, OPTModel

    config = OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                       max_position_embeddings=64, word_embed_proj_dim=32, attn_implementation="eager")
    return _build(OPTModel, config), _text_inputs()


def llama():
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.1, attn_implementation="eager")
    return _build(LlamaModel, config), _text_inputs()


def mistral():
    from transformers import MistralConfig, MistralModel

    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           sliding_window=4, attention_dropout=0.1, attn_implementation="eager")
    return _build(MistralModel, config), _text_inputs()


def phi():
    from transformers import PhiConfig, PhiModel

    config = PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64, resid_pdrop=0.1, embd_pdrop=0.1,
                       attention_dropout=0.1, attn_implementation="eager")
    return _build(PhiModel, config), _text_inputs()


def t5_encoder():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, attn_implementation="eager")
    return _build(T5EncoderModel, config), _text_inputs()


def vit():
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                       attn_implementation="eager")
    return _build(ViTModel, config), _image_inputs(32)


def swin():
    from transformers import SwinConfig, SwinModel

    config = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, drop_path_rate=0.2,
                        attn_implementation="eager")
    return _build(SwinModel, config), _image_inputs(32)


def convnext():
    from transformers import ConvNextConfig, ConvNextModel

    config = ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=32, drop_path_rate=0.5,
                            layer_scale_init_value=1.0)  # the default 1e-6 would hide the residual branch
    return _build(ConvNextModel, config), _image_inputs(32)


def resnet():
    from transformers import ResNetConfig, ResNetModel

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    return _build(ResNetModel, config), _image_inputs(32)


def mobilenet_v2():
    from transformers import MobileNetV2Config, MobileNetV2Model

    config = MobileNetV2Config(image_size=32, depth_multiplier=0.25, min_depth=4, finegrained_output=False)
    return _build(MobileNetV2Model, config), _image_inputs(32)


TRANSFORMERS: dict[str, Callable[[], tuple[nn.Module, dict]]] = {
    "bert": bert,
    "distilbert": distilbert,
    "gpt2": gpt2,
    "opt": opt,
    "llama": llama,
    "mistral": mistral,
    "phi": phi,
    "t5_encoder": t5_encoder,
    "vit": vit,
    "swin": swin,
    "convnext": convnext,
    "resnet": resnet,
    "mobilenet_v2": mobilenet_v2,
}
