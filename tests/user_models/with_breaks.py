"""Models with graph breaks, written the way research code is: one graph cannot hold them, TorchDynamo cuts them.

Each entry of :data:`BREAK_MODELS` is a factory returning a :class:`~hand_written.UserModel` (eval mode,
BatchNorm statistics set) and :data:`BREAK_LINES` the code of the line each model breaks at (what the report
must name).

Example:
    >>> case = BREAK_MODELS["item_scale"]()
    >>> case.model(*case.inputs).shape
    torch.Size([4, 10])
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from hand_written import GPT, UserModel, _settle, data_branch
from torch import nn


class ItemScale(nn.Module):
    """Normalises by ``x.abs().max().item()`` (a Python float) before an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        scale = x.abs().max().item()
        h = F.gelu(self.fc1(self.norm(x / (scale + 1e-6))))
        return self.fc2(h)


def item_scale() -> UserModel:
    torch.manual_seed(0)
    return UserModel(ItemScale().eval(), (torch.randn(4, 16),), [(torch.randn(7, 16) * 3,), (torch.randn(1, 16),)],
                     why="fx records .item() as a node: one graph for fxforge, a break for dynamo", cli_inputs=["4x16"])


class PrintDebug(nn.Module):
    """A conv net that prints a shape halfway, as one does while debugging."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))

    def forward(self, x):
        h = self.stem(x)
        print("stem:", tuple(h.shape), end="\r")
        return self.head(h)


def print_debug() -> UserModel:
    torch.manual_seed(0)
    model = _settle(PrintDebug(), torch.randn(4, 3, 16, 16))
    return UserModel(model, (torch.randn(2, 3, 16, 16),), [(torch.randn(3, 3, 20, 24),), (torch.randn(2, 3, 16, 16),)],
                     why="torch.export runs print as Python: one graph for fxforge, a break for dynamo",
                     cli_inputs=["2x3x16x16"])


class NumpyThreshold(nn.Module):
    """Clips activations at a quantile numpy computes on the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.fc2 = nn.Linear(24, 6)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        top = np.quantile(h.detach().cpu().numpy(), 0.9)
        return self.fc2(torch.clamp(h, max=torch.as_tensor(top, dtype=h.dtype)))


def numpy_threshold() -> UserModel:
    torch.manual_seed(0)
    return UserModel(NumpyThreshold().eval(), (torch.randn(8, 12),), [(torch.randn(5, 12),)], capturable=False,
                     exportable=False, cli_inputs=["8x12"])


class RaggedLoop(nn.Module):
    """A recurrent cell stepped over ``lengths.max()`` steps, outputs appended to a list."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.cell = nn.GRUCell(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x, lengths):
        h = torch.zeros(x.shape[0], 16)
        steps = []
        for t in range(int(lengths.max())):
            h = self.cell(torch.tanh(self.embed(x[:, t])), h)
            steps.append(self.out(h))
        return torch.stack(steps, 1)


def ragged_loop() -> UserModel:
    torch.manual_seed(0)
    return UserModel(RaggedLoop().eval(), (torch.randn(2, 6, 8), torch.tensor([4, 6])),
                     [(torch.randn(3, 9, 8), torch.tensor([9, 2, 5])), (torch.randn(2, 6, 8), torch.tensor([3, 3]))],
                     capturable=False, exportable=False)


class MaskedPool(nn.Module):
    """Averages the tokens above a threshold with boolean indexing (an op whose output size depends on values)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        kept = h[h.mean(-1) > 0]
        pooled = kept.mean(0, keepdim=True) if kept.numel() else h.mean((0, 1)).unsqueeze(0)
        return self.head(pooled)


def masked_pool() -> UserModel:
    torch.manual_seed(0)
    return UserModel(MaskedPool().eval(), (torch.randn(2, 10, 16),), [(torch.randn(3, 7, 16),)], capturable=False,
                     exportable=False, cli_inputs=["2x10x16"])


@torch.compiler.disable
def jitter(x: torch.Tensor) -> torch.Tensor:
    """A helper its author keeps out of torch.compile."""
    return x + 0.01 * torch.sin(x * 7)


class DisabledHelper(nn.Module):
    """A conv net calling a ``torch.compiler.disable``d helper between two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6())
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 2, 1))

    def forward(self, x):
        return self.b(jitter(self.a(x)))


def disabled_helper() -> UserModel:
    torch.manual_seed(0)
    model = _settle(DisabledHelper(), torch.randn(4, 3, 16, 16))
    return UserModel(model, (torch.randn(1, 3, 16, 16),), [(torch.randn(2, 3, 12, 20),)],
                     why="fx traces through a disabled helper: one graph for fxforge, a break for dynamo",
                     cli_inputs=["1x3x16x16"])


class GreedyDecoder(nn.Module):
    """Greedy generation with the hand-written GPT: a token per step until every row emitted ``eos``."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT()
        self.eos = 3

    def forward(self, ids):
        for _ in range(4):
            logits = self.gpt(ids)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            if bool((nxt == self.eos).all()):
                break
        return ids


def greedy_decoder() -> UserModel:
    torch.manual_seed(0)
    return UserModel(GreedyDecoder().eval(), (torch.randint(0, 64, (2, 5)),),
                     [(torch.randint(0, 64, (3, 9)),), (torch.randint(0, 64, (1, 4)),)], capturable=False,
                     exportable=False, cli_inputs=["2x5:int64"])


class HFGreedy(nn.Module):
    """transformers' GPT-2 (random weights, tiny) decoding greedily until every row emitted ``eos``: the
    generation-style loop of research code, around a library model."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.lm = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
                                             bos_token_id=0, eos_token_id=1))

    def forward(self, ids):
        for _ in range(3):
            nxt = self.lm(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            if (nxt == 1).all():
                break
        return ids


def hf_greedy() -> UserModel:
    torch.manual_seed(0)
    return UserModel(HFGreedy().eval(), (torch.randint(2, 64, (2, 6)),), [(torch.randint(2, 64, (3, 9)),)],
                     capturable=False, exportable=False, cli_inputs=["2x6:int64"])


BREAK_MODELS: dict[str, Callable[[], UserModel]] = {
    "data_branch": data_branch,
    "item_scale": item_scale,
    "print_debug": print_debug,
    "numpy_threshold": numpy_threshold,
    "ragged_loop": ragged_loop,
    "masked_pool": masked_pool,
    "disabled_helper": disabled_helper,
    "greedy_decoder": greedy_decoder,
    "hf_greedy": hf_greedy,
}

# The code of the line each model breaks at under TorchDynamo (the first, where there are several).
BREAK_LINES: dict[str, str | None] = {
    "data_branch": "if h.sum() > 0:",
    "item_scale": "scale = x.abs().max().item()",
    "print_debug": 'print("stem:", tuple(h.shape), end="\\r")',
    "numpy_threshold": None,  # dynamo traces numpy through torch: one graph
    "ragged_loop": "for t in range(int(lengths.max())):",
    "masked_pool": "kept = h[h.mean(-1) > 0]",
    "disabled_helper": "return self.b(jitter(self.a(x)))",
    "greedy_decoder": "if bool((nxt == self.eos).all()):",
    "hf_greedy": "if (nxt == 1).all():",
}


def break_model(name: str) -> nn.Module:
    """The model of ``BREAK_MODELS[name]`` alone, for the command line (``--model-args '{"name": "item_scale"}'``).

    Example:
        >>> type(break_model("masked_pool")).__name__
        'MaskedPool'
    """
    return BREAK_MODELS[name]().model
