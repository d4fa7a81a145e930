"""A BERT-like transformer encoder with self-attention written out by hand (no nn.MultiheadAttention)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections and a ``masked_fill`` padding mask.

    Args:
        d_model: Model width.
        num_heads: Number of heads; must divide ``d_model``.
        dropout: Dropout on the attention probabilities.

    Example:
        >>> attn = SelfAttention(32, 4)
        >>> attn(torch.randn(2, 5, 32), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq_len, d_model = x.shape[0], x.shape[1], x.shape[2]
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        probs = self.dropout(probs)
        out = probs @ v

        out = out.transpose(1, 2).contiguous().view(batch, seq_len, d_model)
        return self.out_proj(out)


class FusedSelfAttention(nn.Module):
    """Multi-head self-attention with one fused qkv projection (``chunk``) and an additive mask.

    Args:
        d_model: Model width.
        num_heads: Number of heads; must divide ``d_model``.
        dropout: Dropout on the attention probabilities.

    Example:
        >>> attn = FusedSelfAttention(32, 4)
        >>> attn(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.scale = self.head_dim**-0.5
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, S, D = x.shape[0], x.shape[1], x.shape[2]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.reshape(B, S, self.num_heads, -1).permute(0, 2, 1, 3)
        k = k.reshape(B, S, self.num_heads, -1).permute(0, 2, 1, 3)
        v = v.reshape(B, S, self.num_heads, -1).permute(0, 2, 1, 3)

        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if attention_mask is not None:
            scores = scores + (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * -10000.0
        probs = scores.softmax(dim=-1)
        probs = F.dropout(probs, p=self.dropout, training=self.training)
        out = torch.matmul(probs, v)

        out = out.permute(0, 2, 1, 3).reshape(B, S, D)
        return self.proj(out)


class EncoderLayer(nn.Module):
    """Post-LayerNorm encoder layer: x = LN(x + attn(x)); x = LN(x + MLP(x)), MLP with GELU.

    Args:
        d_model: Model width.
        num_heads: Number of attention heads.
        mlp_ratio: Hidden width of the MLP as a multiple of ``d_model``.
        dropout: Dropout on attention probabilities and sublayer outputs.
        fused_qkv: Use :class:`FusedSelfAttention` instead of :class:`SelfAttention`.

    Example:
        >>> layer = EncoderLayer(32, 4, fused_qkv=True)
        >>> layer(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(
        self, d_model: int, num_heads: int, mlp_ratio: int = 4, dropout: float = 0.1, fused_qkv: bool = False
    ) -> None:
        super().__init__()
        attention = FusedSelfAttention if fused_qkv else SelfAttention
        self.attn = attention(d_model, num_heads, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(),
            nn.Linear(mlp_ratio * d_model, d_model),
        )
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm1(x + self.dropout(self.attn(x, attention_mask)))
        return self.norm2(x + self.dropout(self.mlp(x)))


class TransformerEncoder(nn.Module):
    """Token embedding + learned positions, a stack of encoder layers; returns the hidden states.

    Args:
        vocab_size: Number of token ids.
        d_model: Model width.
        num_heads: Number of attention heads.
        num_layers: Number of encoder layers.
        max_len: Longest sequence the learned positions cover.
        mlp_ratio: Hidden width of the MLPs as a multiple of ``d_model``.
        dropout: Dropout probability.
        fused_qkv: ``True`` or ``False`` for every layer; ``None`` (default) alternates, separate q/k/v
            projections in even layers and a fused qkv projection in odd ones.

    Inputs:
        input_ids: int64 ``[batch, seq_len]``.
        attention_mask: optional ``[batch, seq_len]``, 1 for tokens to attend to, 0 for padding. Every
            sequence must keep at least one token.

    Example:
        >>> model = TransformerEncoder(vocab_size=100, d_model=64, num_heads=4, num_layers=2).eval()
        >>> ids = torch.randint(0, 100, (2, 16))
        >>> mask = torch.ones(2, 16, dtype=torch.long)
        >>> model(ids, mask).shape
        torch.Size([2, 16, 64])
    """

    def __init__(
        self,
        vocab_size: int = 100,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        max_len: int = 64,
        mlp_ratio: int = 4,
        dropout: float = 0.1,
        fused_qkv: bool | None = None,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.emb_norm = nn.LayerNorm(d_model)
        self.emb_dropout = nn.Dropout(dropout)
        fused = [bool(i % 2) if fused_qkv is None else fused_qkv for i in range(num_layers)]
        self.layers = nn.ModuleList(
            EncoderLayer(d_model, num_heads, mlp_ratio, dropout, fused_qkv=f) for f in fused
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(positions)
        x = self.emb_dropout(self.emb_norm(x))
        for layer in self.layers:
            x = layer(x, attention_mask)
        return x


def example() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A 2-layer TransformerEncoder in eval mode, 2 sequences of 16 tokens, the second one padded.

    Example:
        >>> model, (ids, mask) = example()
        >>> model(ids, mask).shape
        torch.Size([2, 16, 64])
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TransformerEncoder(vocab_size=100, d_model=64, num_heads=4, num_layers=2, max_len=64).eval()
        input_ids = torch.randint(0, 100, (2, 16))
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[1, 11:] = 0
    return model, (input_ids, attention_mask)
