"""The models of the training benchmark, and per-block activation checkpointing for any of them.

:func:`build` makes one model in train mode with seeded random weights and no dropout (so every contender's
gradients can be compared with eager's), with its inputs: transformers' GPT-2, BERT and LLaMA with LM heads
on token ids, torchvision's ResNet-50 and timm's ViT-S/16 on images. The last two need the zoo environment
(``.venv-zoo``; see :mod:`benchmarks.zoo`): :data:`ZOO_MODELS`.

:func:`checkpoint_blocks` wraps the repeated blocks of a model in
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, found the same way in every model: a
``ModuleList`` or ``Sequential`` whose children are two or more modules of one class that have children of
their own (transformer layers, ResNet's bottlenecks in ``layerN``, ViT's blocks); the search does not go into
a container it wrapped, nor into the blocks.

Example:
    >>> spec = SIZES["quick"]["gpt2"]
    >>> model, inputs = build("gpt2", spec)
    >>> model.training, tuple(inputs[0].shape)
    (True, (2, 32))
    >>> checkpoint_blocks(model)
    ['transformer.h']
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

HF_MODELS = ("gpt2", "bert", "llama")
ZOO_MODELS = ("resnet50", "vit_small")
MODELS = (*HF_MODELS, *ZOO_MODELS)


@dataclasses.dataclass(frozen=True)
class Spec:
    """A model's size: transformers models by ``hidden``/``layers``/``heads``/``vocab`` at ``seq`` tokens,
    image models at ``image`` x ``image``; ``batch`` for both."""

    batch: int = 8
    seq: int = 512
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 8000
    image: int = 224

    def describe(self, model: str) -> str:
        """One line for the results.

        Example:
            >>> Spec().describe("llama")
            'batch 8, S 512, hidden 256, 4 layers, 4 heads (2 key/value), vocab 8000'
        """
        if model in ZOO_MODELS:
            return f"batch {self.batch}, {self.image}x{self.image}"
        kv = f" ({self.kv_heads} key/value)" if model == "llama" else ""
        return (f"batch {self.batch}, S {self.seq}, hidden {self.hidden}, {self.layers} layers, {self.heads} heads"
                f"{kv}, vocab {self.vocab}")


FULL = Spec()
QUICK = Spec(batch=2, seq=32, hidden=32, layers=2, heads=2, kv_heads=1, vocab=256, image=64)
SIZES: dict[str, dict[str, Spec]] = {"full": {m: FULL for m in MODELS}, "quick": {m: QUICK for m in MODELS}}

DESCRIPTIONS = {
    "gpt2": "transformers GPT2LMHeadModel, token ids in, logits out",
    "bert": "transformers BertForMaskedLM, token ids in, logits out",
    "llama": "transformers LlamaForCausalLM (SwiGLU MLP, grouped key/value heads), token ids in, logits out",
    "resnet50": "torchvision resnet50 (BatchNorm in train mode)",
    "vit_small": "timm vit_small_patch16_224",
}


def zoo_available() -> bool:
    """Whether this environment has torchvision and timm (the zoo environment).

    Example:
        >>> zoo_available() in (True, False)
        True
    """
    return all(importlib.util.find_spec(m) is not None for m in ("torchvision", "timm"))


def build(name: str, spec: Spec = FULL, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``name`` (one of :data:`MODELS`) in train mode, seeded random weights, dropout 0; and its inputs.

    Example:
        >>> model, (ids,) = build("bert", SIZES["quick"]["bert"])
        >>> ids.dtype, model.config.hidden_dropout_prob
        (torch.int64, 0.0)
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if name in HF_MODELS:
        model = _transformers_model(name, spec)
        return model.train(), (torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=gen),)
    if name in ZOO_MODELS:
        model = _zoo_model(name, spec)
        return model.train(), (torch.randn(spec.batch, 3, spec.image, spec.image, generator=gen),)
    raise KeyError(f"unknown model {name!r}; the models are {', '.join(MODELS)}")


def _transformers_model(name: str, spec: Spec) -> nn.Module:
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=spec.vocab, n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
                            n_positions=spec.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0, use_cache=False)
        return GPT2LMHeadModel(config)
    if name == "bert":
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                            num_attention_heads=spec.heads, intermediate_size=4 * spec.hidden,
                            max_position_embeddings=spec.seq, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, use_cache=False)
        return BertForMaskedLM(config)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden,
                         intermediate_size=-(-8 * spec.hidden // 3 // 16) * 16, num_hidden_layers=spec.layers,
                         num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                         max_position_embeddings=spec.seq, attention_dropout=0.0, use_cache=False)
    return LlamaForCausalLM(config)


def _zoo_model(name: str, spec: Spec) -> nn.Module:
    from benchmarks.zoo import define_torchvision_op_schemas

    define_torchvision_op_schemas()
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(weights=None)
    import timm

    return timm.create_model("vit_small_patch16_224", pretrained=False, img_size=spec.image)


# --------------------------------------------------------------------------------------------------
# per-block checkpointing


class CheckpointedBlock(nn.Module):
    """``block`` run under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: its activations
    are dropped after the forward and recomputed in the backward (only its inputs are saved).

    Example:
        >>> block = CheckpointedBlock(torch.nn.Linear(2, 2))
        >>> block(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def repeated_blocks(container: nn.Module) -> bool:
    """Whether ``container`` is a ``ModuleList``/``Sequential`` of two or more blocks of one class, each with
    children of its own (a stack of layers, not a row of leaf ops).

    Example:
        >>> repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
        False
    """
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(container.children())
    return (len(children) >= 2 and len({type(c) for c in children}) == 1
            and all(any(True for _ in c.children()) for c in children))


def checkpoint_blocks(model: nn.Module) -> list[str]:
    """Wrap every repeated block of ``model`` in :class:`CheckpointedBlock`, in place; returns the names of
    the containers whose blocks were wrapped (empty: the model has none, nothing changed).

    The parameters stay the model's own, in the same order (under one more name level, ``.block``).

    Example:
        >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(3)])
        >>> checkpoint_blocks(net), type(net[0]).__name__
        ([''], 'CheckpointedBlock')
    """
    wrapped = []

    def visit(module: nn.Module, name: str) -> None:
        if repeated_blocks(module):
            for i, child in enumerate(list(module.children())):
                module[i] = CheckpointedBlock(child)
            wrapped.append(name)
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    return wrapped
