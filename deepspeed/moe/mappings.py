# SPDX-License-Identifier: Apache-2.0
"""Token gather and drop over the model-parallel group (upstream's ``gather_tokens`` / ``drop_tokens``).

With tensor parallelism every model-parallel rank holds the same tokens; a MoE layer may drop
to this rank's ``1/mp`` slice of them before dispatch and gather them back after. Both are
autograd functions whose backward is the other. With model-parallel size 1 (the only size the
engine accepts in this release) both are the identity.
"""

import torch

import deepspeed.comm as dist
from deepspeed.utils import groups


def _mp_group():
    if not dist.is_initialized():
        return None, 1, 0
    return groups._get_model_parallel_group(), groups._get_model_parallel_world_size(), \
        groups._get_model_parallel_rank()


def _gather_tokens(input_, dim=0):
    group, world, _ = _mp_group()
    if world == 1:
        return input_
    parts = [torch.empty_like(input_) for _ in range(world)]
    dist.all_gather(parts, input_.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _drop_tokens(input_, dim=0):
    _, world, rank = _mp_group()
    if world == 1:
        return input_
    size = input_.shape[dim]
    if size % world != 0:
        raise ValueError(f"drop_tokens: dimension {dim} of size {size} is not divisible by the model-parallel size "
                         f"{world}")
    return torch.narrow(input_, dim, rank * (size // world), size // world).contiguous()


class _GatherTokens(torch.autograd.Function):

    @staticmethod
    def forward(ctx, input_, dim):
        ctx.dim = dim
        return _gather_tokens(input_, dim)

    @staticmethod
    def backward(ctx, grad_output):
        return _drop_tokens(grad_output, ctx.dim), None


class _DropTokens(torch.autograd.Function):

    @staticmethod
    def forward(ctx, input_, dim):
        ctx.dim = dim
        return _drop_tokens(input_, dim)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_tokens(grad_output, ctx.dim), None


def gather_tokens(input_, dim=0):
    """Every model-parallel rank's slice of ``input_`` along ``dim``, concatenated (identity at size 1)."""
    return _GatherTokens.apply(input_, dim)


def drop_tokens(input_, dim=0):
    """This model-parallel rank's slice of ``input_`` along ``dim`` (identity at size 1)."""
    return _DropTokens.apply(input_, dim)
