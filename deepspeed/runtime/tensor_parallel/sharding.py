# SPDX-License-Identifier: Apache-2.0
"""Applying a sharding plan: the one function that turns a model into its tensor-parallel form.

:func:`apply_plan` (every rank of the group, same plan):

1. reads the head counts from the model's config (``tp_shard``: attention dimensions are cut at
   whole key/value head groups) and checks every cut before touching anything: a rank that
   would hold no head, an attention projection cut inside a head, a row-parallel layer whose
   input is cut differently than the column-parallel layer before it would compute a wrong
   model, so they raise on every rank before any collective;
2. makes a ZeRO-3 partitioned model (built under ``zero.Init``) whole again, parameter by
   parameter (its shards span the whole world; the engine re-partitions over the data-parallel
   group);
3. starts every rank of the group from the same values: each parameter and buffer is
   broadcast from the group's first rank before it is cut (one tensor at a time, through the
   communication device), except the parameters of tensor-parallel layers the model already holds
   (built by hand from ``module_inject.layers``): each rank's piece is its own;
4. replaces each planned ``nn.Linear`` by its tensor-parallel layer (``module_inject.layers``),
   which keeps the module's parameters and cuts them in place.
"""

import torch
from torch import nn

import deepspeed.comm as dist
from deepspeed.module_inject import tp_shard
from deepspeed.module_inject.layers import (TP_LAYOUT_ATTR, LinearAllreduce, LinearLayer, ShardLayout,
                                            SubParamLinearAllreduce, SubParamLinearLayer, _sub_sizes_from_shape)
from deepspeed.runtime.zero.partition_parameters import gather_param, is_zero_param
from deepspeed.utils.logging import log_dist

_ZERO_ATTRS = ("ds_id", "ds_numel", "ds_shape", "ds_shard_numel", "ds_tensor", "ds_status", "ds_persist")


def _config_value(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def set_head_counts(model):
    """Tell ``tp_shard`` the model's head counts (attention cuts follow whole key/value head groups)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", config)
    heads = _config_value(config, "num_attention_heads", "n_head")
    kv = _config_value(config, "num_key_value_heads", "num_kv_heads") or heads
    tp_shard.set_num_attention_heads(heads)
    tp_shard.set_num_kv_heads(kv)
    tp_shard.set_n_embd(_config_value(config, "hidden_size", "n_embd"))
    head_dim = _config_value(config, "head_dim")
    if head_dim is None and heads:
        hidden = _config_value(config, "hidden_size", "n_embd")
        head_dim = hidden // heads if hidden and hidden % heads == 0 else None
    return heads, kv, head_dim


def _layout_of(name, module, rule, tp_size):
    full = tuple(getattr(module.weight, "ds_shape", module.weight.shape))
    dim = 0 if rule.kind == "column" else 1
    sub = _sub_sizes_from_shape(rule.shape, rule.partition_dim if rule.partition_dim is not None else dim, full,
                                name) if rule.shape is not None else None
    return ShardLayout.cut(full, dim, tp_size, name, sub)


def check_plan(model, plan, tp_size, head_dim=None):
    """Every cut of ``plan`` is valid (module docstring, step 1); returns ``{name: layout of the weight}``."""
    layouts = {}
    for name, rule in plan.layers.items():
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"AutoTP: {name} is a {type(module).__name__}; only torch.nn.Linear layers are "
                                      f"cut in training")
        if rule.kind not in ("column", "row"):
            raise ValueError(f"AutoTP: {name}: unknown partition type {rule.kind!r}")
        layout = _layout_of(name, module, rule, tp_size)
        widths = [layout.width(r) for r in range(tp_size)]
        if tp_size > 1 and min(widths) == 0:
            raise ValueError(f"AutoTP: {name}: cutting dimension {layout.dim} ({layout.full_shape[layout.dim]}) over "
                             f"{tp_size} ranks leaves a rank without any of it (widths {widths}); use a smaller "
                             f"tensor-parallel size (at most the number of key/value heads)")
        attention = any(part in name.lower() for part in ("attn", "attention"))
        if attention and head_dim and any(w % head_dim for w in widths) and rule.shape is None:
            raise ValueError(f"AutoTP: {name}: the cut {widths} of dimension {layout.dim} does not fall between heads "
                             f"of {head_dim}; the model's head counts do not allow tensor-parallel size {tp_size}")
        layouts[name] = layout
    return layouts


@torch.no_grad()
def _whole_again(model):
    """Parameters partitioned by ``zero.Init`` become whole, plain parameters (a collective per parameter)."""
    for param in model.parameters():
        if is_zero_param(param):
            gather_param(param)
            for attr in _ZERO_ATTRS:
                if hasattr(param, attr):
                    delattr(param, attr)


@torch.no_grad()
def _broadcast_from_first(model, group, src, comm_device):
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.numel() == 0 or getattr(tensor, TP_LAYOUT_ATTR, None) is not None:
            continue
        staged = tensor.data.to(comm_device)
        dist.broadcast(staged, src=src, group=group)
        if staged is not tensor.data:
            tensor.data.copy_(staged)


def _replace(model, name, layer):
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, layer)


def apply_plan(model, plan, group, src_rank, comm_device):
    """Cut ``model`` in place by ``plan`` over ``group`` (module docstring); returns ``{name: layer}``."""
    tp_size = dist.get_world_size(group=group) if group is not None else 1
    _, _, head_dim = set_head_counts(model)
    check_plan(model, plan, tp_size, head_dim)
    _whole_again(model)
    if tp_size > 1:
        _broadcast_from_first(model, group, src_rank, comm_device)
    layers = {}
    for name, rule in plan.layers.items():
        module = model.get_submodule(name)
        if rule.kind == "column":
            if rule.shape is not None:
                layer = SubParamLinearLayer(module,
                                            group,
                                            shape=rule.shape,
                                            partition_dim=rule.partition_dim or 0,
                                            gather_output=rule.gather_output,
                                            name=name)
            else:
                layer = LinearLayer(module, group, gather_output=rule.gather_output, name=name)
        elif rule.shape is not None:
            layer = SubParamLinearAllreduce(module,
                                            group,
                                            shape=rule.shape,
                                            partition_dim=rule.partition_dim if rule.partition_dim is not None else 1,
                                            name=name)
        else:
            layer = LinearAllreduce(module, group, name=name)
        _replace(model, name, layer)
        layers[name] = layer
    model.ds_autotp_parsed = True
    log_dist(f"AutoTP: cut {len(layers)} linear layers over {tp_size} ranks ({plan.describe()})", ranks=[0])
    return layers
