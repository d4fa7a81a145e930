"""The model suite: named factories returning ``(model, example_inputs)`` with the model in eval mode.

Entries come from three places:

* ``examples.models.EXAMPLES`` (the example user models; imported lazily, when the entry is built);
* transformers models built from configs with random weights and ``attn_implementation="eager"``
  (``return_dict=False`` and ``use_cache=False`` so that outputs are plain tuples of tensors);
* tiny built-ins for the harness's own smoke test (``default=False``: they run only when named with
  ``--models``).

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

import torch
from torch import nn

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
        default: run when ``--models`` is not given.
    """

    name: str
    factory: Factory
    group: str = ""
    description: str = ""
    default: bool = True


def build(entry: SuiteEntry, seed: int = 0) -> tuple[nn.Module, tuple]:
    """Build ``entry`` with a fixed seed; returns ``(model.eval(), example_inputs)``."""
    torch.manual_seed(seed)
    model, args = entry.factory()
    if not isinstance(args, tuple):
        args = (args,)
    return model.eval(), args


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
    model = ResNetForImageClassification(config)
    calibrate_batchnorm(model, lambda: (torch.randn(4, 3, 224, 224),))
    return model, (torch.randn(1, 3, 224, 224),)


def hf_mobilenet_v2() -> tuple[nn.Module, tuple]:
    """transformers MobileNetV2Model, default config (1.0 width, 224), 1x3x224x224; BN calibrated."""
    from transformers import MobileNetV2Config, MobileNetV2Model

    config = MobileNetV2Config(return_dict=False)
    model = MobileNetV2Model(config)
    calibrate_batchnorm(model, lambda: (torch.randn(4, 3, 224, 224),))
    return model, (torch.randn(1, 3, 224, 224),)


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
# the suite, in run order

SUITE: list[SuiteEntry] = [
    *(SuiteEntry(n, _example(n), "examples", f"examples.models.EXAMPLES[{n!r}]") for n in EXAMPLE_NAMES),
    SuiteEntry("hf_bert", hf_bert, "transformers", hf_bert.__doc__.strip()),
    SuiteEntry("hf_gpt2", hf_gpt2, "transformers", hf_gpt2.__doc__.strip()),
    SuiteEntry("hf_resnet", hf_resnet, "transformers", hf_resnet.__doc__.strip()),
    SuiteEntry("hf_mobilenet_v2", hf_mobilenet_v2, "transformers", hf_mobilenet_v2.__doc__.strip()),
    SuiteEntry("hf_vit", hf_vit, "transformers", hf_vit.__doc__.strip()),
    SuiteEntry("tiny_mlp", tiny_mlp, "builtin", TinyMLP.__doc__.strip(), default=False),
    SuiteEntry("tiny_conv_bn", tiny_conv_bn, "builtin", TinyConvBN.__doc__.strip(), default=False),
]


def select(names: list[str] | None, suite: list[SuiteEntry] | None = None) -> list[SuiteEntry]:
    """The entries named (in the order given), or the default entries; unknown names raise KeyError."""
    suite = SUITE if suite is None else suite
    if not names:
        return [e for e in suite if e.default]
    by_name = {e.name: e for e in suite}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise KeyError(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]
