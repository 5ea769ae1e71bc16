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


class TinyMoE(nn.Module):
    """A mixture of experts: each token goes to the expert its gate scores highest (top-1 routing).

    Which experts run depends on the data, so in one step an expert may run on one rank
    and not on another; an expert no token picked does not run and gets no gradient.
    ``last_used`` records the experts of the last forward (for tests).
    """

    def __init__(self, experts=4):
        super().__init__()
        self.gate = nn.Linear(DIM, experts, bias=False)
        # each expert large enough to root a unit of its own with small units (stage3_prefetch_bucket_size 100)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM)) for _ in range(experts))
        self.last_used = []

    def forward(self, h):
        flat = h.reshape(-1, DIM)
        logits = self.gate(flat)
        weights = torch.softmax(logits.float(), dim=-1).to(flat.dtype)
        choice = logits.argmax(dim=-1)
        out = torch.zeros_like(flat)
        self.last_used = []
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            self.last_used.append(e)
            out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, e:e + 1])
        return out.view_as(h)


class MoENet(nn.Module):
    """Embedding -> block -> mixture of experts (residual) -> head; the experts block is a ZeRO-3 leaf module."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.moe = TinyMoE()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, **_):
        h = self.block(self.emb(tokens))
        return self.head(h + self.moe(h))


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
