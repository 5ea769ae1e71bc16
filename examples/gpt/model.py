# SPDX-License-Identifier: Apache-2.0
"""A small GPT-style decoder for the training example, in plain PyTorch.

Token embedding plus learned positions, ``n_layers`` pre-LayerNorm blocks of causal self-attention
(``scaled_dot_product_attention``) and a GELU MLP, a final LayerNorm and an output head tied to the token embedding.
``GPT(config)(tokens, targets)`` returns the mean next-token cross-entropy, ``GPT(config)(tokens)`` the logits.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model shape; the defaults give a model that trains for a few steps in seconds on a CPU."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self):
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position attends only to itself and earlier positions."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        # (batch, seq, 3 * width) -> three (batch, heads, seq, head_dim) tensors.
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    """Position-wise feed-forward layer: Linear -> GELU -> Linear."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden)
        self.proj = nn.Linear(hidden, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only language model over ``config.vocab_size`` tokens and at most ``config.seq_len`` positions."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one parameter, two uses
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``tokens``: (batch, seq) int64 with seq <= ``seq_len``.

        Returns the mean cross-entropy against ``targets`` (same shape as ``tokens``) when given, computed in fp32
        whatever the model's dtype; otherwise the (batch, seq, vocab) logits.
        """
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than seq_len {self.config.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
