# SPDX-License-Identifier: Apache-2.0
"""The GPT-style decoder every system of the training benchmark trains.

Token embedding plus learned positions, ``n_layers`` pre-LayerNorm blocks (causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)`` on a fused QKV projection, then a 4x GELU MLP), a final
LayerNorm and an output head tied to the token embedding. ``GPT(cfg)(tokens)`` returns the logits; ``lm_loss``
is the mean next-token cross-entropy computed in fp32.

Initialisation is GPT-2's (normal, std 0.02; the projections into the residual stream scaled by
``1/sqrt(2 * n_layers)``), drawn from the global RNG, so the same seed gives the same model on every rank and for
every system.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    d_model: int = 2048
    n_layers: int = 24
    n_heads: int = 16
    vocab: int = 50304
    seq: int = 2048
    activation_checkpointing: bool = False

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")


class CausalSelfAttention(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        batch, seq, width = x.shape
        # (batch, seq, 3 * width) -> q, k, v of shape (batch, heads, seq, head_dim)
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, targets):
    """Mean next-token cross-entropy, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_params(model: GPT):
    """(all parameters, parameters that do matmul work per token: all but the position embedding).

    The tied token embedding is counted once: as the output head it is a (d_model x vocab) matmul per token.
    """
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.pos_emb.weight.numel()


def flops_per_token(cfg: GPTConfig, n_matmul_params: int):
    """Training FLOPs per token: ``6 * N + 12 * L * d_model * seq`` (weights, forward and backward, plus attention
    scores and values; the attention term counts the full, not the causal, score matrix, as is customary)."""
    return 6 * n_matmul_params + 12 * cfg.n_layers * cfg.d_model * cfg.seq
