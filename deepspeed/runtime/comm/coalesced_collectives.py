# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``deepspeed.runtime.comm.coalesced_collectives``: several reduce-scatters as one collective.

``reduce_scatter_coalesced(tensors, group)`` returns, for each tensor ``t`` (any shape, taken flat), this rank's
piece of the *mean* of ``t`` over the group: with ``c = ceil(t.numel() / W)``, rank ``r`` gets elements
``[r * c, min((r + 1) * c, numel))`` (the last ranks' pieces may be shorter, or empty). All pieces travel in one
reduce-scatter over a buffer laid out rank by rank, each tensor's piece padded to ``c``. The inputs are not
modified.

The quantized reductions of ZeRO++ (``all_to_all_quant_reduce``, ``all_to_all_loco_quant_reduce``: qgZ) are not
built and raise ``NotImplementedError``.
"""

import math
from typing import List

import torch
from torch import Tensor

import deepspeed.comm as dist
from deepspeed.utils.nvtx import instrument_w_nvtx

quantizer_module = None


def _torch_reduce_scatter_fn(input_tensor: Tensor, output_tensor: Tensor, group=None, async_op=False, prof=False):
    return dist.reduce_scatter_fn(output_tensor, input_tensor, group=group, async_op=False)


@instrument_w_nvtx
@torch.no_grad()
def reduce_scatter_coalesced(tensors: List[Tensor], group=None) -> List[Tensor]:
    """See the module docstring (a collective: every rank passes tensors of the same sizes, in the same order)."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    flats = [t.reshape(-1) for t in tensors]
    chunks = [math.ceil(t.numel() / world) for t in flats]
    row = sum(chunks)
    if not tensors:
        return []
    buffer = torch.zeros(world * row, dtype=flats[0].dtype, device=flats[0].device)
    for r in range(world):
        at = r * row
        for flat, c in zip(flats, chunks):
            piece = flat[r * c:min((r + 1) * c, flat.numel())]
            buffer[at:at + piece.numel()].copy_(piece)
            at += c
    buffer.div_(world)  # the mean: pre-divided so the sum of W ranks does not overflow a 16-bit dtype
    mine = torch.empty(row, dtype=buffer.dtype, device=buffer.device)
    _torch_reduce_scatter_fn(buffer, mine, group=group)
    out, at = [], 0
    for flat, c in zip(flats, chunks):
        length = max(0, min(c, flat.numel() - rank * c))
        out.append(mine.narrow(0, at, length))
        at += c
    return out


def all_to_all_quant_reduce(tensors: List[Tensor], groups: dict) -> List[Tensor]:
    raise NotImplementedError("quantized gradient reduction (ZeRO++ qgZ, zero_quantized_gradients) is not built in "
                              "this runtime; see docs/compatibility.md")


def all_to_all_loco_quant_reduce(params: List[Tensor], groups: dict, loco_param=None) -> List[Tensor]:
    raise NotImplementedError("quantized gradient reduction with error feedback (LoCo-ZeRO++) is not built in this "
                              "runtime; see docs/compatibility.md")
