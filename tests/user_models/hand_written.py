"""Models written the way users write them, not the way benchmarks do.

Each entry of :data:`USER_MODELS` is a factory returning a :class:`UserModel`: the model (eval mode,
BatchNorm statistics set by a few train-mode passes), the example inputs a user would pass (one example,
often of batch 1), and *fresh* inputs of other shapes the optimized model must serve like eager.

Example:
    >>> case = USER_MODELS["unet"]()
    >>> case.model(*case.inputs).shape
    torch.Size([1, 2, 64, 64])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class UserModel:
    """One user model: the model, its example inputs, fresh inputs of other shapes.

    Attributes:
        model: The module, in eval mode.
        inputs: Positional example inputs (what the user hands to ``optimize``).
        fresh: Further positional input tuples of new shapes/values, compared with eager.
        kwargs: Keyword example inputs, if the model takes them.
        fresh_kwargs: Keyword inputs of the calls in ``fresh`` (by position; none where the list is shorter).
        capturable: False when the model cannot be one whole graph (data-dependent branch, numpy).
        exportable: False when ONNX export cannot serve it at all (and why in ``why``).
        cli_inputs: The ``--input`` arguments the CLI takes for it, or None where the CLI cannot express them.
    """

    model: nn.Module
    inputs: tuple[Any, ...]
    fresh: list[tuple[Any, ...]] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    fresh_kwargs: list[dict[str, Any]] = field(default_factory=list)
    capturable: bool = True
    exportable: bool = True
    why: str = ""
    cli_inputs: list[str] | None = None


def fresh_calls(case: UserModel) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``(args, kwargs)`` of each fresh call of ``case``.

    Example:
        >>> [kw for _, kw in fresh_calls(USER_MODELS["unet"]())]
        [{}, {}, {}]
    """
    return [(args, case.fresh_kwargs[i] if i < len(case.fresh_kwargs) else {}) for i, args in enumerate(case.fresh)]


def _settle(model: nn.Module, *inputs: Any, passes: int = 3) -> nn.Module:
    """Set BatchNorm running statistics by a few train-mode passes, then return the model in eval mode."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        model.train()
        with torch.no_grad():
            for _ in range(passes):
                model(*inputs)
    return model.eval()


# ----------------------------------------------------------------------------------------------- U-Net


class Block(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x)))


class UNet(nn.Module):
    """Two levels down, two up, skip concatenations, transposed-conv upsampling."""

    def __init__(self, channels: int = 3, classes: int = 2, width: int = 8) -> None:
        super().__init__()
        self.down1 = Block(channels, width)
        self.down2 = Block(width, width * 2)
        self.mid = Block(width * 2, width * 4)
        self.up2 = nn.ConvTranspose2d(width * 4, width * 2, 2, stride=2)
        self.dec2 = Block(width * 4, width * 2)
        self.up1 = nn.ConvTranspose2d(width * 2, width, 2, stride=2)
        self.dec1 = Block(width * 2, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        m = self.mid(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.head(u1)


def unet() -> UserModel:
    torch.manual_seed(0)
    model = _settle(UNet(), torch.randn(4, 3, 64, 64))
    return UserModel(
        model,
        (torch.randn(1, 3, 64, 64),),
        [(torch.randn(2, 3, 64, 48),), (torch.randn(1, 3, 96, 96),), (torch.randn(3, 3, 32, 64),)],
        cli_inputs=["1x3x64x64"],
    )


# ------------------------------------------------------------------------------- nanoGPT, tied weights


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, block: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.heads = heads
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, block: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, block)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's layout: token + position embeddings, blocks, final norm, a head tied to the embedding."""

    def __init__(self, vocab: int = 96, block: int = 64, layers: int = 2, heads: int = 4, dim: int = 32) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, dim),
                "wpe": nn.Embedding(block, dim),
                "h": nn.ModuleList([GPTBlock(dim, heads, block) for _ in range(layers)]),
                "ln_f": nn.LayerNorm(dim),
            }
        )
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx):
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt() -> UserModel:
    torch.manual_seed(0)
    model = GPT().eval()
    return UserModel(
        model,
        (torch.randint(0, 96, (1, 16)),),
        [(torch.randint(0, 96, (2, 25)),), (torch.randint(0, 96, (1, 64)),), (torch.randint(0, 96, (3, 7)),),
         (torch.randint(0, 96, (2, 9), dtype=torch.int32),)],  # int32 ids: eager's embedding takes them too
        cli_inputs=["1x16:int64"],
    )


# ------------------------------------------------------------------------------------------------ LSTM


class LSTMTagger(nn.Module):
    """Embedding -> bidirectional LSTM -> per-token classifier."""

    def __init__(self, vocab: int = 100, dim: int = 16, hidden: int = 24, tags: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, tags)

    def forward(self, tokens):
        h, _ = self.lstm(self.embed(tokens))
        return self.out(h).log_softmax(-1)


def lstm() -> UserModel:
    torch.manual_seed(0)
    return UserModel(
        LSTMTagger().eval(),
        (torch.randint(0, 100, (2, 12)),),
        [(torch.randint(0, 100, (2, 25)),), (torch.randint(0, 100, (5, 12)),), (torch.randint(0, 100, (1, 40)),)],
        cli_inputs=["2x12:int64"],
    )


class GRURegressor(nn.Module):
    """Float sequences through a two-layer GRU; the last step's state regresses one value."""

    def __init__(self, features: int = 6, hidden: int = 16) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def gru() -> UserModel:
    torch.manual_seed(0)
    return UserModel(
        GRURegressor().eval(),
        (torch.randn(4, 10, 6),),
        [(torch.randn(4, 17, 6),), (torch.randn(1, 10, 6),)],
        cli_inputs=["4x10x6"],
    )


# ------------------------------------------------------------------------------------ dict and kwargs


class TwoTower(nn.Module):
    """Takes a dict of an image and token ids (a batch from a DataLoader), returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.text = nn.EmbeddingBag(50, 8, mode="mean")
        self.proj = nn.Linear(16, 4)

    def forward(self, batch):
        img = self.vision(batch["image"]).flatten(1)
        txt = self.text(batch["tokens"])
        return {"logits": self.proj(torch.cat([img, txt], dim=1)), "image_features": img}


def dict_input() -> UserModel:
    torch.manual_seed(0)
    model = _settle(TwoTower(), {"image": torch.randn(4, 3, 16, 16), "tokens": torch.randint(0, 50, (4, 6))})

    def batch(b: int, hw: int, t: int) -> tuple[dict[str, torch.Tensor]]:
        return ({"image": torch.randn(b, 3, hw, hw), "tokens": torch.randint(0, 50, (b, t))},)

    return UserModel(
        model,
        batch(2, 16, 6),
        [batch(3, 16, 6), batch(2, 24, 9)],
        exportable=True,
        cli_inputs=["batch.image=2x3x16x16", "batch.tokens=2x6:int64"],
    )


class KwargsClassifier(nn.Module):
    """Called as ``model(input_ids, attention_mask=mask)``, the HF way."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
        self.cls = nn.Linear(dim, 3)

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)
        pad = None if attention_mask is None else attention_mask == 0
        x = self.layer(x, src_key_padding_mask=pad)
        return self.cls(x.mean(1))


def kwargs_input() -> UserModel:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 10))
    return UserModel(
        KwargsClassifier().eval(),
        (ids,),
        [(torch.randint(0, 64, (3, 14)),), (torch.randint(0, 64, (4, 6)),), (torch.randint(0, 64, (1, 9)),)],
        kwargs={"attention_mask": torch.ones(2, 10, dtype=torch.long)},
        fresh_kwargs=[{"attention_mask": torch.ones(3, 14, dtype=torch.long)},
                      {"attention_mask": torch.tensor([[1] * 6, [1] * 6, [1] * 4 + [0] * 2, [1] * 3 + [0] * 3])}],
        cli_inputs=["input_ids=2x10:int64", "attention_mask=2x10:int64"],
    )


# --------------------------------------------------------------------- shared submodules, many outputs


class SharedEncoder(nn.Module):
    """One encoder applied to two inputs (a siamese network); returns a tuple of three outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))
        self.norm = nn.LayerNorm(16)

    def forward(self, a, b):
        ea, eb = self.norm(self.encoder(a)), self.norm(self.encoder(b))
        return ea, eb, F.cosine_similarity(ea, eb, dim=-1)


def siamese() -> UserModel:
    torch.manual_seed(0)
    return UserModel(
        SharedEncoder().eval(),
        (torch.randn(4, 12), torch.randn(4, 12)),
        [(torch.randn(9, 12), torch.randn(9, 12)), (torch.randn(1, 12), torch.randn(1, 12))],
        cli_inputs=["4x12", "4x12"],
    )


# ------------------------------------------------------------------ custom autograd, in-place ops


class ScaledSwish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, beta):
        ctx.save_for_backward(x)
        ctx.beta = beta
        return x * torch.sigmoid(beta * x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(ctx.beta * x)
        return grad * (s + ctx.beta * x * s * (1 - s)), None


class CustomActivationNet(nn.Module):
    """An MLP with a hand-written autograd function and in-place ops (``relu_``, ``+=``, ``mul_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(20, 40)
        self.fc2 = nn.Linear(40, 40)
        self.fc3 = nn.Linear(40, 10)

    def forward(self, x):
        h = ScaledSwish.apply(self.fc1(x), 1.5)
        y = self.fc2(h)
        y += h
        y.relu_()
        out = self.fc3(y)
        out.mul_(0.5)
        return out


def custom_autograd() -> UserModel:
    torch.manual_seed(0)
    return UserModel(
        CustomActivationNet().eval(),
        (torch.randn(8, 20),),
        [(torch.randn(3, 20),), (torch.randn(16, 20),)],
        cli_inputs=["8x20"],
    )


# ------------------------------------------------------------------- data-dependent branch, numpy


class BranchOnData(nn.Module):
    """``if x.sum() > 0:`` picks one of two heads."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.pos = nn.Conv2d(8, 4, 1)
        self.neg = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        h = self.body(x)
        if h.sum() > 0:
            return self.pos(h)
        return self.neg(h) * -1.0


def data_branch() -> UserModel:
    torch.manual_seed(0)
    model = _settle(BranchOnData(), torch.randn(4, 3, 16, 16))
    return UserModel(
        model,
        (torch.randn(2, 3, 16, 16),),
        [(torch.randn(2, 3, 24, 16),), (-torch.rand(1, 3, 16, 16) - 5.0,)],
        capturable=False,
        exportable=False,
        why="the branch reads a tensor's value",
        cli_inputs=["2x3x16x16"],
    )


class NumpyPostprocess(nn.Module):
    """Calls numpy in forward (a mask built with ``np.tri``) — the trace cannot see into it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        n = x.shape[1]
        mask = torch.from_numpy(np.tri(n, dtype=np.float32))
        return self.fc(x) @ mask


def numpy_call() -> UserModel:
    torch.manual_seed(0)
    return UserModel(
        NumpyPostprocess().eval(),
        (torch.randn(3, 8, 8),),
        [(torch.randn(5, 8, 8),)],
        cli_inputs=["3x8x8"],
    )


USER_MODELS: dict[str, Callable[[], UserModel]] = {
    "unet": unet,
    "gpt": gpt,
    "lstm": lstm,
    "gru": gru,
    "dict_input": dict_input,
    "kwargs_input": kwargs_input,
    "siamese": siamese,
    "custom_autograd": custom_autograd,
    "data_branch": data_branch,
    "numpy_call": numpy_call,
}


def user_model(name: str) -> nn.Module:
    """The model of ``USER_MODELS[name]`` alone, for the command line (``--model-args '{"name": "unet"}'``).

    Example:
        >>> type(user_model("gpt")).__name__
        'GPT'
    """
    return USER_MODELS[name]().model
