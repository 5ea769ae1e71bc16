# SPDX-License-Identifier: Apache-2.0
"""The model, data and plain-torch reference of the Muon tests (no DeepSpeed in the reference).

The model is an embedding (Adam), a chain of linear layers of seeded random widths (odd, 1-wide, smaller than the
world; weights: Muon, biases: Adam) and a 1-wide head called ``lm_head`` (Adam by name). The reference steps a copy
with the global-batch gradient (mean over ranks and micro-batches), clips it, and applies Muon as upstream states it:
momentum ``lerp``, Nesterov ``lerp``, the quintic Newton-Schulz written here in float32 (the standard form), scaled
by ``sqrt(max(1, rows / cols))``, decoupled weight decay; torch's AdamW on the rest.
"""

import math

import torch

VOCAB = 11
A, B, C = 3.4445, -4.7750, 2.0315


def widths(seed):
    gen = torch.Generator().manual_seed(seed)
    dims = [int(torch.randint(1, 9, (1, ), generator=gen)) for _ in range(2)]
    # a 1-wide hidden layer: a (1 x n) and an (n x 1) matrix, both smaller than some worlds
    return [int(torch.randint(2, 7, (1, ), generator=gen)), dims[0], 1, dims[1], 1]


class Net(torch.nn.Module):

    def __init__(self, seed, bias=True, embed=True, init_seed=None):
        super().__init__()
        torch.manual_seed(seed if init_seed is None else init_seed)
        w = widths(seed)
        self.embed = torch.nn.Embedding(VOCAB, w[0]) if embed else None
        self.width = w[0]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=bias) for a, b in zip(w[:-2], w[1:-1]))
        self.lm_head = torch.nn.Linear(w[-2], w[-1], bias=False)

    def forward(self, ids, y):
        x = self.embed(ids) if self.embed is not None else torch.nn.functional.one_hot(ids %
                                                                                       self.width, self.width).float()
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return ((self.lm_head(x).squeeze(-1) - y)**2).mean()


def batch(step, micro, rank, n=4):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (n, ), generator=gen) % 5, torch.randn(n, generator=gen)


def newton_schulz(G, steps=5):
    X = G.float()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        M = X @ X.T
        X = A * X + (B * M + C * M @ M) @ X
    return X.T if tall else X


def is_muon(name, p):
    return p.ndim >= 2 and "embed" not in name and "lm_head" not in name


class Reference:
    """Muon + AdamW (upstream's config defaults unless given) on a copy of ``model``."""

    def __init__(self, model, lr=0.02, adam_lr=3e-4, momentum=0.95, weight_decay=0.0, clip=0.0, low=None, scale=1.0):
        import copy
        self.model = copy.deepcopy(model).float()  # the float32 masters
        # ``low``: a 16-bit model computes forward and backward (of the loss times ``scale``: fp16 loss scaling);
        # the masters start from its rounded values and it gets theirs, rounded, after each step
        self.low, self.scale = (copy.deepcopy(model).to(low) if low is not None else None), scale
        if self.low is not None:
            with torch.no_grad():
                for p, q in zip(self.model.parameters(), self.low.parameters()):
                    p.copy_(q.float())
        self.lr, self.momentum, self.wd, self.clip = lr, momentum, weight_decay, clip
        named = list(self.model.named_parameters())
        self.muon = [p for n, p in named if is_muon(n, p)]
        rest = [p for n, p in named if not is_muon(n, p)]
        self.adam = torch.optim.AdamW(rest, lr=adam_lr, betas=(0.9, 0.95), eps=1e-10, weight_decay=weight_decay)
        self.bufs = {p: torch.zeros_like(p) for p in self.muon}

    def step(self, step, world, gas):
        self.model.zero_grad()
        params = list(self.model.parameters())
        for rank in range(world):
            for micro in range(gas):
                if self.low is None:
                    (self.model(*batch(step, micro, rank)) / (world * gas)).backward()
                    continue
                self.low.zero_grad()
                (self.low(*batch(step, micro, rank)) * self.scale).backward()
                for p, q in zip(params, self.low.parameters()):
                    g = q.grad.float() / self.scale / (world * gas)
                    p.grad = g if p.grad is None else p.grad + g
        if self.clip:
            norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
            coef = min(1.0, self.clip / (float(norm) + 1e-6))
            for p in params:
                p.grad.mul_(coef)
        with torch.no_grad():
            for p in self.muon:
                buf = self.bufs[p]
                buf.lerp_(p.grad, 1 - self.momentum)
                u = p.grad.lerp(buf, self.momentum)
                rows, cols = u.shape
                o = newton_schulz(u) * (math.sqrt(rows / cols) if rows > cols else 1.0)
                p.mul_(1 - self.lr * self.wd)
                p.add_(o, alpha=-self.lr)
        self.adam.step()
        if self.low is not None:
            with torch.no_grad():
                for q, p in zip(self.low.parameters(), self.model.parameters()):
                    q.copy_(p.to(q.dtype))

    def params(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}
