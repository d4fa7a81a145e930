"""The small models of ``--suite throughput``: MobileNetV3-small, EfficientNet-B0 and a BERT-tiny, random weights.

This environment has neither torchvision nor timm, so MobileNetV3-small is written here from its layer table
(Howard et al. 2019, Table 2; the same table, channel rounding, squeeze-excitation and head as torchvision's
``mobilenet_v3_small``: 2.54 M parameters). EfficientNet-B0 is transformers' ``EfficientNetForImageClassification``
with B0's width, depth and resolution; BERT-tiny is ``BertModel`` with hidden 128, 2 layers, 2 heads, FFN 512.
Batch norm statistics are set by a few train-mode passes on random images, then eval mode
(:func:`benchmarks.suite.calibrate_batchnorm`). Nothing is downloaded.

Example:
    >>> model, (x,) = mobilenet_v3_small()
    >>> sum(p.numel() for p in model.parameters()), tuple(model(x).shape)
    (2542856, (1, 1000))
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.suite import calibrated_image_model

# (kernel, expanded, out, squeeze-excitation, activation, stride) per block; input 16 channels after the stem.
SMALL = ((3, 16, 16, True, "RE", 2), (3, 72, 24, False, "RE", 2), (3, 88, 24, False, "RE", 1),
         (5, 96, 40, True, "HS", 2), (5, 240, 40, True, "HS", 1), (5, 240, 40, True, "HS", 1),
         (5, 120, 48, True, "HS", 1), (5, 144, 48, True, "HS", 1), (5, 288, 96, True, "HS", 2),
         (5, 576, 96, True, "HS", 1), (5, 576, 96, True, "HS", 1))


def _divisible(value: float, divisor: int = 8) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _conv(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: str | None = None) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
    if act is not None:
        layers.append(nn.Hardswish() if act == "HS" else nn.ReLU())
    return nn.Sequential(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        squeeze = _divisible(channels // 4)
        self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.mean((2, 3), keepdim=True)
        return x * nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(scale))))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, kernel: int, expanded: int, cout: int, se: bool, act: str, stride: int):
        super().__init__()
        layers: list[nn.Module] = [] if expanded == cin else [_conv(cin, expanded, 1, act=act)]
        layers.append(_conv(expanded, expanded, kernel, stride, groups=expanded, act=act))
        if se:
            layers.append(SqueezeExcitation(expanded))
        layers.append(_conv(expanded, cout, 1))
        self.block, self.residual = nn.Sequential(*layers), stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out + x if self.residual else out


class MobileNetV3Small(nn.Module):
    """MobileNetV3-small, 1000 classes, 224x224 (see the module docstring)."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = [_conv(3, 16, 3, 2, act="HS")]
        cin = 16
        for kernel, expanded, cout, se, act, stride in SMALL:
            layers.append(InvertedResidual(cin, kernel, expanded, cout, se, act, stride))
            cin = cout
        layers.append(_conv(cin, 6 * cin, 1, act="HS"))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(6 * cin, 1024), nn.Hardswish(), nn.Dropout(0.2),
                                        nn.Linear(1024, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


def mobilenet_v3_small() -> tuple[nn.Module, tuple]:
    """MobileNetV3-small, batch norm calibrated, one 1x3x224x224 image."""
    torch.manual_seed(0)
    return calibrated_image_model(MobileNetV3Small())


def efficientnet_b0() -> tuple[nn.Module, tuple]:
    """transformers EfficientNetForImageClassification with B0's coefficients, calibrated, one 1x3x224x224 image."""
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    torch.manual_seed(0)
    config = EfficientNetConfig(width_coefficient=1.0, depth_coefficient=1.0, image_size=224, dropout_rate=0.2,
                                hidden_dim=1280, num_labels=1000, return_dict=False)
    return calibrated_image_model(torchvision_init(EfficientNetForImageClassification(config)))


def torchvision_init(model: nn.Module) -> nn.Module:
    """torchvision's EfficientNet initialization (convolutions Kaiming normal over fan-out, batch norm 1 and 0):
    transformers' (normal, std 0.02) shrinks the activations to 1e-31 by the head, subnormal floats that the CPU
    runs far slower than a trained network's."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            bound = 1.0 / module.out_features ** 0.5
            nn.init.uniform_(module.weight, -bound, bound)
            nn.init.zeros_(module.bias)
    return model


def bert_tiny(seq: int = 128) -> tuple[nn.Module, tuple]:
    """BertModel(hidden 128, 2 layers, 2 heads, FFN 512), eager attention, one request of ``seq`` token ids."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
                        return_dict=False, attn_implementation="eager")
    model = BertModel(config).eval()
    return model, (torch.randint(0, config.vocab_size, (1, seq)),)


MODELS = {"mobilenet_v3_small": mobilenet_v3_small, "efficientnet_b0": efficientnet_b0, "bert_tiny": bert_tiny}
