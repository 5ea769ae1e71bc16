# SPDX-License-Identifier: Apache-2.0
"""Expert parameters: how they are marked, found, and split into optimizer param groups of their own.

An expert parameter carries ``allreduce = False`` and ``group_name = "ep_size_<ep>"`` (the
marks upstream uses): its gradient is reduced over the expert-data-parallel group of that
name, not over every data-parallel rank. :func:`split_params_into_different_moe_groups_for_optimizer`
moves expert parameters into param groups of their own (``moe: True``, ``name`` the group
name), so that ZeRO partitions each group over the ranks it is reduced over.
"""

from typing import Any, Dict, List, Tuple, Union

import torch
from torch import nn

from deepspeed.utils.groups import EXPERT_GROUP_PREFIX


def mark_expert_param(param, group_name):
    """Mark ``param`` as an expert parameter of the expert groups ``group_name``."""
    param.allreduce = False
    param.group_name = group_name
    return param


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (``allreduce`` is False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(m: nn.Module) -> Tuple[bool, int]:
    """``(whether m holds a deepspeed.moe.layer.MoE, that layer's num_experts)`` for the first one found."""
    from deepspeed.moe.layer import MoE
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def expert_parallel_sizes(model: nn.Module) -> List[int]:
    """The distinct expert-parallel sizes of ``model``'s expert parameters, sorted (from their group names)."""
    sizes = set()
    for param in model.parameters():
        if is_moe_param(param):
            sizes.add(expert_group_size(param))
    return sorted(sizes)


def expert_group_size(param) -> int:
    """The expert-parallel size an expert parameter's ``group_name`` names; ValueError for a malformed name."""
    name = getattr(param, "group_name", None)
    if not isinstance(name, str) or not name.startswith(EXPERT_GROUP_PREFIX):
        raise ValueError(f"an expert parameter (allreduce=False) of shape {tuple(param.shape)} has group_name "
                         f"{name!r}; expected '{EXPERT_GROUP_PREFIX}<ep_size>'")
    try:
        return int(name[len(EXPERT_GROUP_PREFIX):])
    except ValueError:
        raise ValueError(f"expert parameter group_name {name!r} does not end in an integer ep_size") from None


def split_params_into_shared_and_expert_params(
        params: List[torch.nn.Parameter]) -> Tuple[List[torch.nn.Parameter], List[torch.nn.Parameter]]:
    """``(shared, expert)`` parameters of ``params``, order kept."""
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
        group: List[torch.nn.Parameter]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``(shared grads, expert grads)`` of the parameters of ``group`` that have a gradient."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Union[Dict[str, Any], Tuple[Dict[str, Any], ...], List[Dict[str, Any]]],
        max_group_size: Union[int, float] = 178956971) -> List[Dict[str, Any]]:
    """Param groups with every expert parameter moved into a group of its own kind.

    Each input group keeps its dense parameters; its expert parameters go to new groups, one
    per expert group name (and further split so that none holds more than ``max_group_size``
    elements), which copy the input group's options and add ``moe: True`` and ``name``.
    """
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise TypeError(f"param_groups must be a dict, tuple or list of dicts, not {type(param_groups).__name__}")
    out = []
    for group in param_groups:
        params = list(group["params"])
        dense = [p for p in params if not is_moe_param(p)]
        by_name = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        if dense or not by_name:
            out.append({**group, "params": dense})
        for name, experts in by_name.items():
            chunk, numel = [], 0
            for p in experts:
                if chunk and numel + p.numel() > max_group_size:
                    out.append({**group, "params": chunk, "moe": True, "name": name})
                    chunk, numel = [], 0
                chunk.append(p)
                numel += p.numel()
            out.append({**group, "params": chunk, "moe": True, "name": name})
    return out


def is_moe_param_group(param_group):
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: List):
    """Param groups for an optimizer built from ``model_parameters`` (parameters or groups), experts apart."""
    model_parameters = list(model_parameters)
    if not model_parameters:
        return model_parameters
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(f"optimizer parameters must be tensors or dicts, got {type(p).__name__}")
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer({
            "params": model_parameters,
            "name": "dense-params"
        })
    if any(is_moe_param_group(g) for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
