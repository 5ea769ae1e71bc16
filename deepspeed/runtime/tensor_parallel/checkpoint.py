# SPDX-License-Identifier: Apache-2.0
"""Whole tensors of a tensor-parallel model: the unsharded state dict, and values for another tensor-parallel size.

* :func:`consolidated_state_dict` (``engine._consolidated_16bit_state_dict()``, ``save_16bit_model``,
  Accelerate's ``get_state_dict``): a collective; rank 0 gets the unsharded Hugging Face state dict
  (the model's parameter names, whole tensors in the model's dtype, persistent buffers; a tied
  parameter under each of its names), every other rank None. Each cut parameter is gathered over
  its tensor-parallel group and reassembled by its :class:`~deepspeed.module_inject.layers.ShardLayout`;
  under ZeRO-3 every parameter is first gathered over its data-parallel group.
* :func:`layout_of_model` / :func:`merge_shards` / :func:`local_piece`: the tensor-parallel
  layout a checkpoint records (name -> layout of each cut parameter), the whole value from every
  tensor-parallel rank's piece, and a rank's piece of a whole value; what saving, the universal
  format and loading at another tensor-parallel size use.
"""

from collections import OrderedDict

import torch

import deepspeed.comm as dist
from deepspeed.module_inject.layers import TP_LAYOUT_ATTR, ShardLayout

TP_LAYOUT_KEY = "tensor_parallel_layout"  # model-states entry: {name: ShardLayout.to_dict()}
TP_SIZE_KEY = "tensor_parallel_size"


def layout_of_model(module):
    """``{parameter name: ShardLayout}`` of every cut parameter of ``module``."""
    out = {}
    for name, param in module.named_parameters():
        layout = getattr(param, TP_LAYOUT_ATTR, None)
        if layout is not None:
            out[name] = layout
    return out


def encode_layout(module):
    return {name: layout.to_dict() for name, layout in layout_of_model(module).items()}


def decode_layout(entry):
    return {name: ShardLayout.from_dict(d) for name, d in (entry or {}).items()}


def merge_shards(layout, shards):
    """The whole tensor from every tensor-parallel rank's piece (``shards`` in rank order)."""
    return layout.assemble(list(shards))


def local_piece(layout, full, tp_size, tp_rank, name=None):
    """Rank ``tp_rank``'s piece of ``full`` at tensor-parallel size ``tp_size`` (the layout re-cut at that size)."""
    if layout.tp_size != tp_size:
        layout = ShardLayout.cut(layout.full_shape, layout.dim, tp_size, name, layout.sub_sizes)
    return layout.local(full, tp_rank)


def recut(layout, tp_size, name=None):
    """``layout`` at another tensor-parallel size (the same rules, so the cut is the one a fresh model gets)."""
    return layout if layout.tp_size == tp_size else ShardLayout.cut(layout.full_shape, layout.dim, tp_size, name,
                                                                    layout.sub_sizes)


def gather_whole(local, layout, group, device):
    """The whole tensor of which this rank holds ``local`` (a collective over ``group``)."""
    world = layout.tp_size
    if world == 1:
        return local
    moved = local.to(device).movedim(layout.dim, 0).contiguous()
    widest = max(layout.width(r) for r in range(world))
    if moved.shape[0] != widest:
        padded = moved.new_zeros((widest, *moved.shape[1:]))
        padded[:moved.shape[0]] = moved
        moved = padded
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    out = out.view(world, *moved.shape)
    return layout.assemble([out[r][:layout.width(r)].movedim(0, layout.dim) for r in range(world)])


def _comm_device():
    if dist.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def consolidated_state_dict(engine, exclude_frozen_parameters=False):
    """See the module docstring (a collective over every rank)."""
    from deepspeed.utils import groups
    module = engine.module
    stage = engine._stage.checkpoint() if engine._stage is not None and engine.zero_optimization_stage() == 3 else None
    group = groups.get_tensor_model_parallel_group()
    device = _comm_device()
    keep = not dist.is_initialized() or dist.get_rank() == 0
    state = OrderedDict() if keep else None
    first_name = {}

    def visit(sub, prefix):
        for name, param in sub.named_parameters(recurse=False):
            if param is None or (exclude_frozen_parameters and not param.requires_grad):
                continue
            key = prefix + name
            if param in first_name:
                if keep:
                    state[key] = state[first_name[param]]
                continue
            first_name[param] = key
            value = stage.full_16bit_value(param) if stage is not None and hasattr(param, "ds_id") else param.detach()
            layout = getattr(param, TP_LAYOUT_ATTR, None)
            if layout is not None and layout.tp_size > 1:
                value = gather_whole(value, layout, group, device)
            if keep:
                state[key] = value.detach().cpu().clone()
        if keep:
            for name, buf in sub.named_buffers(recurse=False):
                if buf is not None and name not in sub._non_persistent_buffers_set:
                    state[prefix + name] = buf.detach().cpu().clone()
        for name, child in sub.named_children():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(module, "")
    return state
