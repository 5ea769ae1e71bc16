# SPDX-License-Identifier: Apache-2.0
"""The tensor-parallel collectives as four small autograd functions, each with its backward beside its forward.

Activations come in two kinds inside a tensor-parallel group: *replicated* (every rank holds
the same tensor: the residual stream, the loss) and *sharded* (each rank holds its slice of the
last dimension: the output of a column-parallel linear). The functions move between them:

==================  ===================================  ===================================
function            forward                              backward
==================  ===================================  ===================================
copy_to_region      identity (replicated -> used by a    all-reduce: the input's gradient is the
                    column shard)                        sum of every shard's contribution
reduce_from_region  all-reduce of the partial products   identity: the gradient of a replicated
                    (row-parallel output)                output is already whole on every rank
gather_from_region  all-gather of the last-dimension     each rank keeps its own slice
                    slices (widths may differ)
scatter_to_region   each rank keeps its own slice        all-gather of the slices
==================  ===================================  ===================================

With these, the gradient of every replicated activation is whole and identical on every rank
(Megatron-LM's convention), the gradient of a sharded parameter is its whole gradient, and a
replicated parameter's local gradient is whole where it acts on replicated activations and
this rank's share where it acts on sharded ones (``replicated.py`` finds which).

``widths`` lists every rank's slice width (uneven sizes: vocabulary 65 over 2 ranks is 33, 32);
slices are padded to the widest for one equal-size all-gather and trimmed after.

``LinearWithAsyncAllreduce`` (``tensor_parallel.tp_overlap_comm``) is the column-parallel linear
in one function, so that the all-reduce of the input's gradient runs while the weight's
gradient is computed.
"""

import torch

import deepspeed.comm as dist


def _world(group):
    return dist.get_world_size(group=group) if group is not None and dist.is_initialized() else 1


def _all_reduce(tensor, group):
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, group=group)
    return tensor


def _gather_last_dim(tensor, group, widths):
    """Concatenate every rank's last-dimension slice (``widths[r]`` wide) in rank order."""
    world = len(widths)
    widest = max(widths)
    local = tensor.contiguous()
    if local.shape[-1] != widest:
        padded = local.new_zeros((*local.shape[:-1], widest))
        padded[..., :local.shape[-1]] = local
        local = padded
    out = local.new_empty((world * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(out, local, group=group)
    out = out.view(world, *local.shape)
    return torch.cat([out[r].narrow(-1, 0, w) for r, w in enumerate(widths)], dim=-1)


def _own_slice(tensor, group, widths):
    rank = dist.get_rank(group=group)
    start = sum(widths[:rank])
    return tensor.narrow(-1, start, widths[rank]).contiguous()


class _CopyToRegion(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group):
        if x.is_contiguous() and not (x.is_leaf and x.requires_grad):
            ctx.mark_dirty(x)  # reduced in place: the partial product is not needed afterwards
        else:
            x = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group, widths):
        ctx.group, ctx.widths = group, widths
        return _gather_last_dim(x, group, widths)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.group, ctx.widths), None, None


class _ScatterToRegion(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group, widths):
        ctx.group, ctx.widths = group, widths
        return _own_slice(x, group, widths)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group, ctx.widths), None, None


def copy_to_region(x, group):
    """A replicated activation about to be used by a column shard (module docstring)."""
    return _CopyToRegion.apply(x, group) if _world(group) > 1 else x


def reduce_from_region(x, group):
    """The sum over the group of partial results (a row-parallel linear's output)."""
    return _ReduceFromRegion.apply(x, group) if _world(group) > 1 else x


def gather_from_region(x, group, widths):
    """The whole last dimension from every rank's slice (``widths``: every rank's slice width)."""
    return _GatherFromRegion.apply(x, group, tuple(widths)) if _world(group) > 1 else x


def scatter_to_region(x, group, widths):
    """This rank's slice of the last dimension of a replicated activation."""
    return _ScatterToRegion.apply(x, group, tuple(widths)) if _world(group) > 1 else x


class LinearWithAsyncAllreduce(torch.autograd.Function):
    """``copy_to_region`` followed by ``F.linear`` in one function: the input gradient's all-reduce is started before
    the weight gradient is computed and waited for after (``tp_overlap_comm``). Same values as the unfused pair."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group = group
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = grad.matmul(weight).contiguous()
        work = dist.all_reduce(grad_input, group=ctx.group, async_op=True)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = flat_grad.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        return grad_input, grad_weight, grad_bias, None


def linear_with_async_allreduce(x, weight, bias, group):
    if _world(group) == 1:
        return torch.nn.functional.linear(x, weight, bias)
    return LinearWithAsyncAllreduce.apply(x, weight, bias, group)
