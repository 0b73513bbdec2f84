"""A small GPT-style language model, written as people write models (not an ``nn.Sequential``): token
and position embeddings, blocks in an ``nn.ModuleList`` iterated in ``forward``, a final LayerNorm, an
output head tied to the token embedding, and a long skip (the embeddings are added again before the
head). ``examples/gpt_text.py`` trains it through a pipe cut at named blocks; the tests and
``benchmarks/bench_any_model.py`` use it too. Importable from the repository root
(``from examples.tiny_gpt import GPT``)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Attention", "Block", "GPT"]


class Attention(nn.Module):
    """Causal self-attention written out (mask from the sequence length), or through SDPA."""

    def __init__(self, d: int, heads: int, sdpa: bool) -> None:
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, sdpa: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, sdpa)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style LM: token and position embeddings (then dropout), blocks in a ModuleList, a final
    LayerNorm, a head tied to the token embedding, and a long skip (the embeddings are added again
    before the head). Blocks alternate written-out attention and SDPA."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 4, context: int = 8,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, sdpa=i % 2 == 1) for i in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        e = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        x = e
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x) + e)
