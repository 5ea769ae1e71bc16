# SPDX-License-Identifier: Apache-2.0
"""The loss of a sequence-parallel group: the token-weighted mean over the group's samples, on every rank.

Each rank of a group holds a shard of the same samples, so its own loss is the mean over its shard's valid tokens
(``shift_labels != -100``). The sample loss is the token-weighted mean of the shards' losses:

    L = sum_r n_r * loss_r / sum_r n_r          (n_r: valid tokens of shard r; a shard without any counts 0)

:func:`sequence_parallel_loss` returns ``L`` on every rank of the group, differentiably: the shard losses are
gathered, and the backward of the gather sums the ranks' gradients (each rank's ``L`` depends on every shard). So
each rank's backward carries ``P`` times its share, the group's gradients add up to ``P * dL``, and averaging the
dense gradients over all ``dp x sp`` ranks gives the mean over the global batch. The Transformers Trainer
(``deepspeed_sp_compute_loss``) computes the same ``L`` the same way, so both meet the same convention.
"""

from typing import Union

import torch
from torch import Tensor

import deepspeed.comm as dist

__all__ = ["sequence_parallel_loss", "gather_scalars", "gradient_divisor"]


def gradient_divisor(data_parallel_size: int, sequence_parallel_size: int) -> int:
    """What the sum of a parameter's gradients over every rank that saw different tokens is divided by.

    Under this convention each of the ``sp`` ranks of a group backpropagates the group's whole loss, so the
    group's gradients add up to ``sp`` times the sample's: dividing by ``dp * sp`` leaves the mean over the
    ``dp`` sample groups, the global batch's mean gradient (``dp * sp`` is also upstream's divisor, so the
    Transformers Trainer and Accelerate, which aggregate the loss this way, train unchanged).
    """
    return int(data_parallel_size) * int(sequence_parallel_size)


class _GatherScalars(torch.autograd.Function):
    """``[x_0, ..., x_{P-1}]`` from the group's scalars; backward: the gradient of ``x_r`` summed over the ranks."""

    @staticmethod
    def forward(ctx, value: Tensor, group) -> Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        pieces = [torch.empty_like(value.reshape(1)) for _ in range(world)]
        dist.all_gather(pieces, value.reshape(1).contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad: Tensor):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.rank].reshape(()), None


def gather_scalars(value: Tensor, group) -> Tensor:
    """The group's scalar ``value``s in group-rank order, differentiable (see :class:`_GatherScalars`)."""
    return _GatherScalars.apply(value, group)


def sequence_parallel_loss(shard_loss: Tensor, shard_tokens: Union[Tensor, int], sp_group) -> Tensor:
    """The token-weighted mean of the group's shard losses (see the module docstring), equal on every rank.

    ``shard_loss``: this rank's mean loss over its ``shard_tokens`` valid tokens (a NaN from a shard with none is
    ignored). With no valid token in the whole group the result is 0 (and so are the gradients).
    """
    tokens = torch.as_tensor(shard_tokens, device=shard_loss.device).to(torch.float32).reshape(())
    tokens_all = torch.empty(dist.get_world_size(sp_group), dtype=torch.float32, device=shard_loss.device)
    pieces = list(tokens_all.chunk(tokens_all.numel()))
    dist.all_gather(pieces, tokens.reshape(1), group=sp_group)
    tokens_all = torch.cat(pieces)
    safe = torch.where(tokens > 0, shard_loss.reshape(()), torch.zeros_like(shard_loss.reshape(())))
    losses = gather_scalars(safe, sp_group)
    weighted = (losses.to(torch.float32) * tokens_all).sum() / tokens_all.sum().clamp(min=1.0)
    return weighted.to(shard_loss.dtype)
