"""Clean models, written the way people write them: ``fxforge lint`` must find nothing above info in them.
:data:`CLEAN` maps a name to a factory returning ``(model, example_inputs)``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLPClassifier(nn.Module):
    def __init__(self, features=32, hidden=64, classes=10, p=0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(p), nn.Linear(hidden, classes))

    def forward(self, x, labels):
        logits = self.net(x)
        return logits, F.cross_entropy(logits, labels)


class SmallCNN(nn.Module):
    def __init__(self, classes=10, p=0.2):
        super().__init__()
        self.p = p
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        )
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        x = F.dropout(x, self.p, training=self.training)
        return self.fc(x)


class Attention(nn.Module):
    def __init__(self, dim=64, heads=4, max_len=128):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // self.heads)
        scores = scores.masked_fill(~self.causal[:T, :T], float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(B, T, C))


class TinyGPT(nn.Module):
    def __init__(self, vocab=100, dim=64, layers=2, max_len=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(dim), "attn": Attention(dim)})
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids) + self.pos[:, : ids.size(1)]
        for block in self.blocks:
            x = x + block["attn"](block["ln"](x))
        return self.head(x)


class SiameseDistance(nn.Module):
    """Pairwise distances by design: the outer difference is made with explicit unsqueezes."""

    def __init__(self, dim=16):
        super().__init__()
        self.enc = nn.Linear(dim, dim)

    def forward(self, a, b):
        ea, eb = self.enc(a), self.enc(b)
        return (ea.unsqueeze(1) - eb.unsqueeze(0)).pow(2).sum(-1)


class RegressionHead(nn.Module):
    def __init__(self, features=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 32), nn.ReLU())
        self.out = nn.Linear(32, 1)

    def forward(self, x, target):
        pred = self.out(self.body(x)).squeeze(-1)
        return F.mse_loss(pred, target)


def _examples() -> dict:
    from examples.models import EXAMPLES

    return {f"examples/{name}": factory for name, factory in EXAMPLES.items()}


CLEAN = {
    "mlp_classifier": lambda: (MLPClassifier().eval(), (torch.randn(8, 32), torch.randint(0, 10, (8,)))),
    "small_cnn": lambda: (SmallCNN().eval(), (torch.randn(2, 3, 16, 16),)),
    "tiny_gpt": lambda: (TinyGPT().eval(), (torch.randint(0, 100, (2, 16)),)),
    "siamese_distance": lambda: (SiameseDistance(), (torch.randn(4, 16), torch.randn(6, 16))),
    "regression_head": lambda: (RegressionHead(), (torch.randn(8, 16), torch.randn(8))),
    **_examples(),
}
