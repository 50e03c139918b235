"""The GPT-like model of the ZeRO++ benchmark and its convergence tests: a
small pre-norm transformer (token and position embeddings, causal SDPA
attention blocks with a 4x GELU MLP, a vocabulary head) trained on a
deterministic synthetic language, a fixed random Markov chain over the
vocabulary whose every token has 4 likely successors, so the loss falls
from log(64) = 4.16 towards the chain's entropy. Built from its seed alone
(no downloads): every rank and framework starts from the same weights and
sees the same data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 64, 16


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, hidden: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, hidden), nn.Embedding(SEQ, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(hidden: int = 64, layers: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(hidden, layers)


def chain() -> torch.Tensor:
    """The language: each token has 4 likely successors (a fixed random table)."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(VOCAB, VOCAB, generator=gen) * 0.5
    top = torch.randint(0, VOCAB, (VOCAB, 4), generator=gen)
    logits.scatter_add_(1, top, torch.full((VOCAB, 4), 4.0))
    return logits.softmax(-1)


def sequences(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    probs = chain()
    ids = torch.empty(rows, SEQ + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (rows,), generator=gen)
    for t in range(SEQ):
        ids[:, t + 1] = torch.multinomial(probs[ids[:, t]], 1, generator=gen).squeeze(1)
    return ids


def lm_loss(logits, ids):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
