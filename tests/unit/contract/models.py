# SPDX-License-Identifier: Apache-2.0
"""Small models whose forward can take every graph shape of the gradient contract."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 16
DIM = 8


class ToyNet(nn.Module):
    """Embedding -> block -> block -> head, plus an auxiliary branch used only on request.

    ``forward(tokens, twice=False, use_aux=False, ckpt=None, hidden=False, residual=False)``:
    ``twice`` applies ``block`` a second time (a module used twice); ``use_aux`` adds
    the auxiliary branch (a parameter unused unless asked for); ``ckpt`` is None,
    "reentrant" or "non_reentrant" activation checkpointing of the blocks; ``hidden``
    returns the features instead of logits.
    """

    def __init__(self, tie=False, empty=False):
        super().__init__()
        # a zero-sized parameter (it is used, and its gradient has no elements)
        self.nothing = nn.Parameter(torch.zeros(0)) if empty else None
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.block2 = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.aux = nn.Linear(DIM, DIM)
        if tie:
            self.head.weight = self.emb.weight

    def body(self, h, twice=False, residual=False):
        h = self.block(h)
        if twice:
            h = self.block(h) + h
        # residual: the body ends in an add, which saves nothing, so a non-reentrant
        # checkpoint stops its recompute early, inside block2 (as in a transformer block)
        return h + self.block2(h) if residual else torch.tanh(self.block2(h))

    def forward(self, tokens, twice=False, use_aux=False, ckpt=None, hidden=False, residual=False):
        h = self.emb(tokens)
        if self.nothing is not None:
            h = h + self.nothing.sum()
        if ckpt is None:
            h = self.body(h, twice, residual)
        else:
            h = checkpoint(self.body, h, twice, residual, use_reentrant=(ckpt == "reentrant"))
        if use_aux:
            h = h + torch.sigmoid(self.aux(h))
        if hidden:
            return h
        return self.head(h)


class Head(nn.Module):
    """A second model that consumes ToyNet features (two engines in one graph)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, h):
        return self.out(torch.tanh(self.proj(h)))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(rank, micro, batch=2, seq=3):
    """Deterministic data of one rank's micro-step (every rank can rebuild every other rank's data)."""
    gen = torch.Generator().manual_seed(1000 * rank + micro + 7)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    targets = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return tokens, targets
