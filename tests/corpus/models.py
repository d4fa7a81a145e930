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

import contextlib
from collections.abc import Callable, Iterator

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


_DROPOUT_OFF = False


def _build(model_cls: type, config) -> nn.Module:
    if _DROPOUT_OFF:
        zero_dropout(config)
    torch.manual_seed(SEED)
    return model_cls(config).eval()


def zero_dropout(config) -> list[str]:
    """Set every dropout-like probability of a transformers config to 0; returns the fields it set.

    A field counts when its name contains "drop" (``hidden_dropout_prob``, ``attn_pdrop``,
    ``dropout_rate``, ``drop_path_rate``, ``layerdrop``...) and its value is a number; ``None`` (unset)
    is left alone.
    """
    fields = [k for k, v in config.to_dict().items()
              if "drop" in k.lower() and isinstance(v, (int, float)) and not isinstance(v, bool)]
    for key in fields:
        setattr(config, key, 0.0)
    return fields


@contextlib.contextmanager
def dropout_off() -> Iterator[None]:
    """Inside, every factory of this module builds its model with all dropout probabilities 0.

    In training mode such a model is deterministic (no random op draws), so gradients through a rewritten
    graph can be compared with eager's without relying on both drawing the same numbers.

    Example:
        >>> with dropout_off():
        ...     model, _ = TRANSFORMERS["bert"]()
        >>> model.config.hidden_dropout_prob, model.config.attention_probs_dropout_prob
        (0.0, 0.0)
    """
    global _DROPOUT_OFF
    before, _DROPOUT_OFF = _DROPOUT_OFF, True
    try:
        yield
    finally:
        _DROPOUT_OFF = before


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


def roberta():
    from transformers import RobertaConfig, RobertaModel

    # RoBERTa's positions start after the padding index (1), hence max_position_embeddings > SEQ + 2.
    config = RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    return _build(RobertaModel, config), _text_inputs()


def gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoModel

    # One global and one local (sliding window of 4 < SEQ) layer; dropout on, so training draws numbers.
    config = GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                          max_position_embeddings=64, attention_types=[[["global", "local"], 1]], window_size=4,
                          embed_dropout=0.1, attention_dropout=0.1, resid_dropout=0.1,
                          bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, attn_implementation="eager")
    return _build(GPTNeoModel, config), _text_inputs()


def qwen2():
    from transformers import Qwen2Config, Qwen2Model

    # Grouped-query attention (4 query heads, 2 key/value heads); layer 0 full, layer 1 a sliding window.
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_sliding_window=True, sliding_window=4, max_window_layers=1, attention_dropout=0.1,
                         attn_implementation="eager")
    return _build(Qwen2Model, config), _text_inputs()


DECODER_SEQ = SEQ - 2  # T5's decoder input is shorter than the encoder's: cross-attention is not square


def t5():
    from transformers import T5Config, T5Model

    # The full encoder-decoder: encoder self-attention, decoder (causal) self-attention and cross-attention.
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0, use_cache=False,
                      attn_implementation="eager")
    inputs = _text_inputs()
    gen = torch.Generator().manual_seed(SEED + 2)
    inputs["decoder_input_ids"] = torch.randint(1, VOCAB, (BATCH, DECODER_SEQ), generator=gen, dtype=torch.int64)
    return _build(T5Model, config), inputs


def deit():
    from transformers import DeiTConfig, DeiTModel

    config = DeiTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                        attn_implementation="eager")
    return _build(DeiTModel, config), _image_inputs(32)


def segformer():
    from transformers import SegformerConfig, SegformerModel

    # Two stages of one block: stage 1 (8x8 tokens) attends to keys/values reduced 2x2 by a strided
    # convolution (16 tokens), stage 2 (4x4 tokens) to all of them.
    config = SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                             patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                             decoder_hidden_size=32, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                             drop_path_rate=0.2, attn_implementation="eager")
    return _build(SegformerModel, config), _image_inputs(32)


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
    "roberta": roberta,
    "gpt_neo": gpt_neo,
    "qwen2": qwen2,
    "t5": t5,
    "deit": deit,
    "segformer": segformer,
    "convnext": convnext,
    "resnet": resnet,
    "mobilenet_v2": mobilenet_v2,
}
