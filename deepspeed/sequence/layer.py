# SPDX-License-Identifier: Apache-2.0
"""Ulysses attention: the all-to-all between a sequence-sharded and a head-sharded layout, and around attention.

Every rank of a sequence-parallel group of size ``P`` holds ``1/P`` of the sequence with every head. Before
attention one all-to-all regroups the tensors so that each rank holds the whole sequence for ``1/P`` of the heads
(attention is independent per head); after it, the inverse all-to-all brings the context back to the sequence
shard. The exchange is its own adjoint up to swapping the two dimensions, so the backward of one all-to-all is the
all-to-all with the dimensions exchanged: gradients are exact, including the contributions that other ranks'
losses make to this rank's activations.

Chunk ``j`` of the scattered dimension goes to group rank ``j``; what rank ``j`` sends lands at position ``j`` of
the gathered dimension. So a sequence shard ``r`` (as ``UlyssesSPDataLoaderAdapter`` hands it out) sits at
position ``r`` of the gathered sequence, and head chunk ``r`` is computed on rank ``r``.
"""

from typing import Any, Optional, Tuple

import torch
from torch import Tensor
from torch.nn import Module

import deepspeed.comm as dist

__all__ = ["single_all_to_all", "DistributedAttention", "apply_rotary_pos_emb"]


def _check_divisible(size: int, world: int, what: str) -> None:
    if size % world != 0:
        raise ValueError(f"sequence parallelism: {what} ({size}) must be divisible by the sequence-parallel world "
                         f"size ({world}); uneven head partitions are not supported (docs/compatibility.md)")


def single_all_to_all(input: Tensor,
                      scatter_idx: int,
                      gather_idx: int,
                      batch_dim_idx: int,
                      group,
                      async_op: bool = False,
                      handle=None,
                      type=None,
                      num_kv_heads=None) -> Tensor:
    """Split ``input`` along ``scatter_idx`` over the group and concatenate what arrives along ``gather_idx``.

    The result has ``input.shape[scatter_idx] / P`` along ``scatter_idx`` and ``P * input.shape[gather_idx]``
    along ``gather_idx`` (``P`` the group's size); chunk ``j`` of the scattered dimension ends on group rank ``j``.
    ``batch_dim_idx`` names the batch dimension (it is carried through unchanged); ``async_op``, ``handle``,
    ``type`` and ``num_kv_heads`` are accepted for upstream's signature: the exchange always completes before it
    returns. Not differentiable by itself: :class:`_SeqAllToAll` is.
    """
    world = dist.get_world_size(group)
    ndim = input.dim()
    scatter_idx, gather_idx = scatter_idx % ndim, gather_idx % ndim
    if scatter_idx == gather_idx:
        raise ValueError(f"single_all_to_all: scatter_idx and gather_idx must differ, both are {scatter_idx}")
    if world == 1:
        return input
    _check_divisible(input.shape[scatter_idx], world, f"dimension {scatter_idx} of a tensor of shape "
                     f"{tuple(input.shape)}")
    # [P, ...chunk]: row j goes to rank j; all_to_all_single splits dim 0 evenly.
    send = torch.stack(torch.tensor_split(input, world, dim=scatter_idx), dim=0).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # Row j came from rank j: its piece of the gathered dimension is the j-th.
    return torch.cat(received.unbind(0), dim=gather_idx)


class _SeqAllToAll(torch.autograd.Function):
    """Differentiable :func:`single_all_to_all`: the backward runs the exchange with the two dimensions swapped."""

    @staticmethod
    def forward(ctx: Any,
                group,
                input: Tensor,
                scatter_idx: int,
                gather_idx: int,
                batch_dim_idx: int,
                stream=None,
                handle=None,
                type=None,
                is_fwd=True,
                num_kv_heads=None) -> Tensor:
        ctx.group = group
        ctx.scatter_idx = scatter_idx
        ctx.gather_idx = gather_idx
        ctx.batch_dim_idx = batch_dim_idx
        return single_all_to_all(input, scatter_idx, gather_idx, batch_dim_idx, group)

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        grad = single_all_to_all(grad_output[0].contiguous(), ctx.gather_idx, ctx.scatter_idx, ctx.batch_dim_idx,
                                 ctx.group)
        return (None, grad, None, None, None, None, None, None, None, None)


# Upstream's flag for its optional fused rotary kernel (the ``torchembed`` package); the torch expression below is
# the only path here.
_torchembed_available = False


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotary embedding of the last dimension of ``t`` (halves rotated), on the first ``freqs_cos.shape[-1]``
    features; the rest pass unchanged. ``freqs_cos``/``freqs_sin`` broadcast against ``t``."""
    rot_dim = freqs_cos.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t_rot = t_rot * freqs_cos + _rotate_half(t_rot) * freqs_sin
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.numel() else t_rot


class DistributedAttention(Module):
    """Attention over a sequence sharded across ``sequence_process_group``.

    ``local_attention(q, k, v, *args, **kwargs)`` is any attention that sees the whole sequence for the heads it
    is given. ``query``/``key``/``value`` come in sequence-sharded with every head (the defaults
    ``scatter_idx=2, gather_idx=0`` are the ``[s/P, b, h, d]`` layout; ``[b, s/P, h, d]`` takes
    ``gather_idx=1``); the context goes back in the layout the query came in. Head counts (query and key/value)
    must divide by the group's size: a clear ``ValueError`` otherwise. ``sp_stream`` is accepted for upstream's
    signature; the exchanges run on the current stream.
    """

    def __init__(
        self,
        local_attention: Module,
        sequence_process_group,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream=None,
        num_kv_heads: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.sp_overlap_comm = False
        self.overlap_handles = None
        self.num_kv_heads = num_kv_heads

    def layer_sync(self, layer) -> None:
        """Nothing to wait for: exchanges are not overlapped (upstream's name, kept for callers)."""

    def forward(self,
                query: Tensor,
                key: Tensor,
                value: Tensor,
                batch_dim_idx: int,
                rotary_pos_emb=None,
                *args: Any,
                **kwargs) -> Tensor:
        """The context, sequence-sharded like ``query``.

        ``rotary_pos_emb``, if given, is ``(cos, sin)`` for the whole sequence, applied to the query and key after
        they were gathered: with ``batch_dim_idx == 1`` in ``[b, s, 1, d]`` layout (permuted to ``[s, b, 1, d]``
        as upstream), else broadcastable to the gathered ``[b, s, h/P, d]`` tensors as given.
        """
        world = dist.get_world_size(self.spg)
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            _check_divisible(tensor.shape[self.scatter_idx], world, f"the {name} head count")
        q = _SeqAllToAll.apply(self.spg, query, self.scatter_idx, self.gather_idx, batch_dim_idx)
        k = _SeqAllToAll.apply(self.spg, key, self.scatter_idx, self.gather_idx, batch_dim_idx)
        v = _SeqAllToAll.apply(self.spg, value, self.scatter_idx, self.gather_idx, batch_dim_idx)
        if rotary_pos_emb is not None:
            cos, sin = rotary_pos_emb
            if batch_dim_idx == 1:
                cos, sin = cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3)
            q = apply_rotary_pos_emb(q, cos, sin)
            k = apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return _SeqAllToAll.apply(self.spg, context, self.gather_idx, self.scatter_idx, batch_dim_idx)
