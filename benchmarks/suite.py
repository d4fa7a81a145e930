"""The model suite: named factories returning ``(model, example_inputs)`` with the model in eval mode.

Entries come from three places:

* ``examples.models.EXAMPLES`` (the example user models; imported lazily, when the entry is built);
* transformers models built from configs with random weights and ``attn_implementation="eager"``
  (``return_dict=False`` and ``use_cache=False`` so that outputs are plain tuples of tensors);
* tiny built-ins for the harness's own smoke test (``default=False``: they run only when named with
  ``--models``).

Entries tagged with a section's name (``tags=("conv",)``) form that section: ``python -m benchmarks
--suite conv`` runs them (see :data:`benchmarks.timed.TIMED`). The section entries are ``default=False``,
so the plain ``python -m benchmarks`` run stays as it was. ``--suite attention`` runs the BERT encoder at
S = 512 / 1024 / 2048 and the LLaMA decoder at S = 2048.

Nothing is downloaded: every model is built from a config with random (seeded) weights.

Adding a model::

    from benchmarks.suite import SUITE, SuiteEntry
    SUITE.append(SuiteEntry("my_model", my_factory, group="mine"))
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

Factory = Callable[[], tuple[nn.Module, tuple]]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class SuiteEntry:
    """One model of the suite.

    Attributes:
        name: the name used by ``--models`` and in the tables.
        factory: ``() -> (model, example_inputs)``; the model in eval mode.
        group: where it comes from ("examples", "transformers", "builtin").
        description: one line for ``--list``.
        default: run when neither ``--models`` nor ``--suite`` is given.
        tags: the sections (``--suite NAME``) the entry belongs to.
    """

    name: str
    factory: Factory
    group: str = ""
    description: str = ""
    default: bool = True
    tags: tuple[str, ...] = ()


def build(entry: SuiteEntry, seed: int = 0) -> tuple[nn.Module, tuple]:
    """Build ``entry`` with a fixed seed; returns ``(model.eval(), example_inputs)``."""
    torch.manual_seed(seed)
    model, args = entry.factory()
    if not isinstance(args, tuple):
        args = (args,)
    return model.eval(), args


def random_like_batch(x: Any, batch: int) -> Any:
    """A random tensor like ``x`` but with ``batch`` rows (same non-batch shape and dtype); non-tensors as is.

    Floating tensors are drawn from ``randn``; other dtypes (token ids, masks) take random rows of ``x``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    if x.is_floating_point():
        return torch.randn(batch, *x.shape[1:], dtype=x.dtype, device=x.device)
    return x[torch.randint(0, x.shape[0], (batch,), device=x.device)]


def rebatched(factory: Factory, batch: int) -> Factory:
    """``factory`` with every tensor input replaced by a random one of batch size ``batch``."""

    def wrapped() -> tuple[nn.Module, tuple]:
        model, args = factory()
        args = args if isinstance(args, tuple) else (args,)
        return model, tree_map(lambda x: random_like_batch(x, batch), args)

    wrapped.__name__ = f"{getattr(factory, '__name__', 'factory')}_b{batch}"
    return wrapped


# --------------------------------------------------------------------------------------------------
# examples.models


def _example(name: str) -> Factory:
    def factory() -> tuple[nn.Module, tuple]:
        if REPO_ROOT not in sys.path:
            sys.path.insert(0, REPO_ROOT)
        from examples.models import EXAMPLES

        return EXAMPLES[name]()

    factory.__name__ = f"example_{name}"
    return factory


EXAMPLE_NAMES = ["resnet_cnn", "densenet", "inception", "unet", "transformer_encoder"]


# --------------------------------------------------------------------------------------------------
# transformers (random weights, from configs)


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, make_input: Callable[[], tuple], steps: int = 4) -> nn.Module:
    """Set every BatchNorm's running statistics from a few random batches, then go back to eval mode.

    With random weights (transformers initialises convolutions with std 0.02) activations shrink layer
    after layer (MobileNetV2's outputs are ~1e-21) while a trained network keeps them near unit scale.
    Recomputing the running statistics (cumulative average, as BN recalibration does) restores a
    realistic scale, so that latencies and errors are those of a working network.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [bn.momentum for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    model.train()
    try:
        for _ in range(steps):
            model(*make_input())
    finally:
        for bn, momentum in zip(bns, momenta):
            bn.momentum = momentum
        model.eval()
    return model


def calibrated_image_model(model: nn.Module, size: int = 224) -> tuple[nn.Module, tuple]:
    """``model`` with its BatchNorm statistics calibrated on random images, and one random 1x3xSxS image."""
    calibrate_batchnorm(model, lambda: (torch.randn(4, 3, size, size),))
    return model, (torch.randn(1, 3, size, size),)


def hf_bert() -> tuple[nn.Module, tuple]:
    """BERT, hidden 256, 4 layers, 4 heads, batch 1, sequence 128."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        attn_implementation="eager",
        return_dict=False,
    )
    model = BertModel(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (1, 128))
    attention_mask = torch.ones(1, 128, dtype=torch.long)
    return model, (input_ids, attention_mask)


def hf_bert_base() -> tuple[nn.Module, tuple]:
    """BERT-base: BertModel, default config (hidden 768, 12 layers, 12 heads), eager attention, batch 1, sequence 128."""
    from transformers import BertConfig, BertModel

    config = BertConfig(attn_implementation="eager", return_dict=False)
    model = BertModel(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (1, 128))
    attention_mask = torch.ones(1, 128, dtype=torch.long)
    return model, (input_ids, attention_mask)


def hf_gpt2() -> tuple[nn.Module, tuple]:
    """GPT-2, n_embd 256, 4 layers, 4 heads, batch 1, sequence 128, no KV cache."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        n_embd=256,
        n_layer=4,
        n_head=4,
        n_positions=128,
        attn_implementation="eager",
        use_cache=False,
        return_dict=False,
    )
    model = GPT2Model(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (1, 128))
    return model, (input_ids,)


def hf_resnet() -> tuple[nn.Module, tuple]:
    """ResNet-18-sized transformers ResNetForImageClassification (basic blocks), 1x3x224x224; BN calibrated."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        embedding_size=64,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        hidden_act="relu",
        num_labels=1000,
        return_dict=False,
    )
    return calibrated_image_model(ResNetForImageClassification(config))


def hf_mobilenet_v2() -> tuple[nn.Module, tuple]:
    """transformers MobileNetV2Model, default config (1.0 width, 224), 1x3x224x224; BN calibrated."""
    from transformers import MobileNetV2Config, MobileNetV2Model

    config = MobileNetV2Config(return_dict=False)
    return calibrated_image_model(MobileNetV2Model(config))


def hf_resnet50() -> tuple[nn.Module, tuple]:
    """ResNet-50: ResNetForImageClassification, default config, 1000 labels, 1x3x224x224; BN calibrated."""
    from transformers import ResNetConfig, ResNetForImageClassification

    # The default config, with ImageNet's 1000 labels (the config's default is 2), as in hf_resnet.
    config = ResNetConfig(num_labels=1000, return_dict=False)
    return calibrated_image_model(ResNetForImageClassification(config))


def hf_mobilenet_v2_224() -> tuple[nn.Module, tuple]:
    """MobileNetV2ForImageClassification, default config, 1000 labels, 1x3x224x224; BN calibrated."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    config = MobileNetV2Config(num_labels=1000, return_dict=False)
    return calibrated_image_model(MobileNetV2ForImageClassification(config))


def hf_vit() -> tuple[nn.Module, tuple]:
    """Small ViT: hidden 256, 4 layers, 4 heads, patch 16, 1x3x224x224 (197 tokens)."""
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        image_size=224,
        patch_size=16,
        attn_implementation="eager",
        return_dict=False,
    )
    model = ViTModel(config, add_pooling_layer=False).eval()
    return model, (torch.randn(1, 3, 224, 224),)


# --------------------------------------------------------------------------------------------------
# tiny built-ins (smoke tests)


class TinyMLP(nn.Module):
    """Linear -> ReLU -> Linear; small enough that every contender prepares in seconds."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def tiny_mlp() -> tuple[nn.Module, tuple]:
    return TinyMLP().eval(), (torch.randn(4, 32),)


class TinyConvBN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> Linear: a conv_bn_fold / conv_activation target."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(x.mean(dim=(2, 3)))


def tiny_conv_bn() -> tuple[nn.Module, tuple]:
    model = TinyConvBN()
    with torch.no_grad():  # non-trivial running statistics, so that folding them is visible
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model.eval(), (torch.randn(1, 3, 16, 16),)


# --------------------------------------------------------------------------------------------------
# the conv section (issue 3): ``python -m benchmarks --suite conv``

CONV_EXAMPLES = ["densenet", "inception", "unet"]
CONV_BATCHES = (1, 8)


def _conv_entry(name: str, factory: Factory, group: str, description: str) -> SuiteEntry:
    tags = ("conv", "onnx") if name in ONNX_MODELS else ("conv",)
    return SuiteEntry(name, factory, group, description, default=False, tags=tags)


def conv_entries() -> list[SuiteEntry]:
    """The conv section's entries (tag ``conv``, not default): each model at batch 1 and batch 8.

    The example CNNs are named ``<name>_b<batch>`` (``densenet`` itself is batch 2); the transformers
    models keep their plain name at batch 1 (``hf_resnet50``) and get ``_b8`` at batch 8 (same weights).
    """
    entries = [
        _conv_entry(f"{name}_b{batch}", rebatched(_example(name), batch), "examples",
                    f"examples.models.EXAMPLES[{name!r}], batch {batch}")
        for name in CONV_EXAMPLES
        for batch in CONV_BATCHES
    ]
    for factory in (hf_resnet50, hf_mobilenet_v2_224):
        doc = factory.__doc__.strip()
        for batch in CONV_BATCHES:
            if batch == 1:
                entries.append(_conv_entry(factory.__name__, factory, "transformers", doc))
            else:
                entries.append(_conv_entry(f"{factory.__name__}_b{batch}", rebatched(factory, batch),
                                           "transformers", doc.replace("1x3x", f"{batch}x3x")))
    return entries


# --------------------------------------------------------------------------------------------------
# the attention section (issue 4): ``python -m benchmarks --suite attention``

ATTENTION_ENCODER_SEQS = (512, 1024, 2048)
ATTENTION_DECODER_SEQS = (2048,)


def bert_encoder(seq: int, *, hidden: int = 256, layers: int = 4, heads: int = 4,
                 vocab: int = 30522) -> Factory:
    """A BERT encoder (transformers BertModel, eager attention), batch 1, sequence ``seq``, no padding.

    The default size is the suite's ``hf_bert`` (hidden 256, 4 layers, 4 heads of 64, FFN 1024) without
    its pooler; the position table holds at least ``seq`` positions. The all-ones ``attention_mask`` is
    passed as real callers pass it: transformers turns it into a [1, 1, S, S] float mask. Smoke tests pass
    a smaller size.
    """

    def factory() -> tuple[nn.Module, tuple]:
        from transformers import BertConfig, BertModel

        config = BertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            max_position_embeddings=max(seq, 512),
            attn_implementation="eager",
            return_dict=False,
        )
        model = BertModel(config, add_pooling_layer=False).eval()
        input_ids = torch.randint(0, vocab, (1, seq))
        attention_mask = torch.ones(1, seq, dtype=torch.long)
        return model, (input_ids, attention_mask)

    factory.__name__ = f"bert_encoder_s{seq}"
    return factory


def llama_decoder(seq: int, *, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                  vocab: int = 32000) -> Factory:
    """A LLaMA decoder (transformers LlamaModel, eager attention), batch 1, sequence ``seq``, causal, no cache.

    Default: hidden 256, 4 layers, 4 query heads of 64 sharing 2 key/value heads (grouped-query attention),
    SwiGLU MLP of 688 (8/3 of hidden, rounded up to a multiple of 16).
    """

    def factory() -> tuple[nn.Module, tuple]:
        from transformers import LlamaConfig, LlamaModel

        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=-(-8 * hidden // 3 // 16) * 16,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max(seq, 512),
            attn_implementation="eager",
            use_cache=False,
            return_dict=False,
        )
        model = LlamaModel(config).eval()
        return model, (torch.randint(0, vocab, (1, seq)),)

    factory.__name__ = f"llama_decoder_s{seq}"
    return factory


# The ONNX section (issue 6, ``--suite onnx``) reuses entries of the others: attention at S >= 1024 and the
# transformers CNNs at batch 1.
ONNX_MODELS = ("bert_s1024", "bert_s2048", "llama_s2048", "hf_resnet50", "hf_mobilenet_v2_224")


def _attention_entry(name: str, factory: Factory, description: str) -> SuiteEntry:
    tags = ("attention", "onnx") if name in ONNX_MODELS else ("attention",)
    if name == "bert_s1024":  # also a row of the targets section (issue 21), which runs in the zoo environment
        tags, factory = (*tags, "targets"), _in_zoo_environment(factory)
    return SuiteEntry(name, factory, "transformers", description, default=False, tags=tags)


def attention_entries() -> list[SuiteEntry]:
    """The attention section's entries (tag ``attention``, not default), in run order.

    ``bert_s512``, ``bert_s1024``, ``bert_s2048`` (the encoder at three lengths: how latency and peak memory
    grow with S) and ``llama_s2048`` (the causal decoder).
    """
    return [
        *(_attention_entry(f"bert_s{seq}", bert_encoder(seq),
                           f"BertModel, hidden 256, 4 layers, 4 heads, eager attention, batch 1, sequence {seq}")
          for seq in ATTENTION_ENCODER_SEQS),
        *(_attention_entry(f"llama_s{seq}", llama_decoder(seq),
                           f"LlamaModel, hidden 256, 4 layers, 4 heads / 2 KV heads, eager attention, batch 1, "
                           f"sequence {seq}, causal")
          for seq in ATTENTION_DECODER_SEQS),
    ]


# The targets section (issue 21, ``--suite targets``): torchvision and timm models (their rows need the zoo
# environment, ``make zoo``: elsewhere they fail with the import error) and transformers encoders/decoders.
TARGETS_VISION = (("torchvision", "resnet50", 224), ("torchvision", "mobilenet_v3_large", 224),
                  ("torchvision", "efficientnet_b0", 224), ("torchvision", "convnext_tiny", 224),
                  ("torchvision", "inception_v3", 299), ("torchvision", "vit_b_16", 224),
                  ("torchvision", "swin_t", 224), ("timm", "vit_small_patch16_224", 224))


def _zoo_factory(source: str, arch: str, size: int) -> Factory:
    def factory() -> tuple[nn.Module, tuple]:
        from benchmarks.zoo import build_arch

        return build_arch(source, arch, size)

    factory.__name__ = f"{source}_{arch}"
    return factory


def _in_zoo_environment(factory: Factory) -> Factory:
    """``factory`` with torchvision's op schemas declared first (where the zoo environment's torchvision
    cannot load its compiled ops, importing transformers would otherwise fail importing torchvision)."""

    def wrapped() -> tuple[nn.Module, tuple]:
        from benchmarks.zoo import define_torchvision_op_schemas

        define_torchvision_op_schemas()
        return factory()

    wrapped.__name__ = factory.__name__
    return wrapped


def targets_entries() -> list[SuiteEntry]:
    """The targets section's entries (tag ``targets``, not default): the vision models of
    :data:`TARGETS_VISION` at batch 1 (BatchNorm statistics from three train-mode passes), BERT at S = 128 and
    1024, LLaMA at S = 1024."""
    vision = [SuiteEntry(f"{source}/{arch}", _zoo_factory(source, arch, size), source,
                         f"{source} {arch}, random weights, batch 1, {size}x{size}", default=False, tags=("targets",))
              for source, arch, size in TARGETS_VISION]
    text = [SuiteEntry("bert_s128", _in_zoo_environment(bert_encoder(128)), "transformers",
                       "BertModel, hidden 256, 4 layers, 4 heads, eager attention, batch 1, sequence 128",
                       default=False, tags=("targets",)),
            SuiteEntry("llama_s1024", _in_zoo_environment(llama_decoder(1024)), "transformers",
                       "LlamaModel, hidden 256, 4 layers, 4 heads / 2 KV heads, eager attention, batch 1, "
                       "sequence 1024, causal", default=False, tags=("targets",))]
    return vision + text  # and bert_s1024 of the attention entries, tagged "targets" too


# --------------------------------------------------------------------------------------------------
# the suite, in run order

SUITE: list[SuiteEntry] = [
    *(SuiteEntry(n, _example(n), "examples", f"examples.models.EXAMPLES[{n!r}]") for n in EXAMPLE_NAMES),
    SuiteEntry("hf_bert", hf_bert, "transformers", hf_bert.__doc__.strip()),
    SuiteEntry("hf_gpt2", hf_gpt2, "transformers", hf_gpt2.__doc__.strip()),
    SuiteEntry("hf_resnet", hf_resnet, "transformers", hf_resnet.__doc__.strip()),
    SuiteEntry("hf_mobilenet_v2", hf_mobilenet_v2, "transformers", hf_mobilenet_v2.__doc__.strip()),
    SuiteEntry("hf_vit", hf_vit, "transformers", hf_vit.__doc__.strip()),
    SuiteEntry("hf_bert_base", hf_bert_base, "transformers", hf_bert_base.__doc__.strip(), default=False),
    SuiteEntry("tiny_mlp", tiny_mlp, "builtin", TinyMLP.__doc__.strip(), default=False),
    SuiteEntry("tiny_conv_bn", tiny_conv_bn, "builtin", TinyConvBN.__doc__.strip(), default=False),
    *conv_entries(),
    *attention_entries(),
    *targets_entries(),
]


def select(
    names: list[str] | None, suite: list[SuiteEntry] | None = None, tag: str | None = None
) -> list[SuiteEntry]:
    """The entries named (in the order given), else those tagged ``tag``, else the default entries.

    Unknown names raise KeyError.
    """
    suite = SUITE if suite is None else suite
    if not names:
        return [e for e in suite if (tag in e.tags if tag else e.default)]
    by_name = {e.name: e for e in suite}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise KeyError(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]
