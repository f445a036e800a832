"""The decoder-only transformer LM the benchmarks train (shared by bench_*.py)."""

from __future__ import annotations

import torch
from torch import nn


class LM(nn.Module):
    """Decoder-only transformer LM: embedding, ``layers`` pre-norm blocks, untied head."""

    def __init__(self, vocab: int, ctx: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.emb(x) + self.pos, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def batch_for(step: int, vocab: int, batch: int, ctx: int) -> torch.Tensor:
    """Deterministic synthetic tokens for ``step``: (batch, ctx + 1)."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (batch, ctx + 1), generator=g)


def train_step(model: LM, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """Forward, next-token loss, backward and optimizer step on ``x``."""
    out = model(x[:, :-1])
    loss = nn.functional.cross_entropy(out.reshape(-1, model.vocab), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
