# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``deepspeed.runtime.zero.utils``: ZeRO helper functions and the list of tested optimizers.

``is_zero_supported_optimizer(opt)`` says whether ``type(opt)`` is one of the optimizers ZeRO is tested with
(``ZERO_SUPPORTED_OPTIMIZERS``); others need ``zero_allow_untested_optimizer``. ``apply_to_tensors_only``
maps a function over the tensors of a nested output (tuples, lists, namedtuples, dicts in place), as the
ZeRO-3 module hooks do. The rank-agreement helpers are collectives: call them on every rank.
"""

import gc
from typing import List, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
from deepspeed.utils.logging import logger

warned = False


class ZeRORuntimeException(Exception):
    """An error ZeRO raises at run time (upstream's name)."""


ZERO_SUPPORTED_OPTIMIZERS = [
    torch.optim.Adam, torch.optim.AdamW, FusedAdam, DeepSpeedCPUAdam, torch.optim.Adagrad, DeepSpeedCPUAdagrad,
    FusedLion, DeepSpeedCPULion
]


def is_zero_supported_optimizer(optimizer):
    """Whether ``type(optimizer)`` is exactly one of ``ZERO_SUPPORTED_OPTIMIZERS``."""
    return type(optimizer) in ZERO_SUPPORTED_OPTIMIZERS


def get_norm_dtype():
    """The dtype gradient norms accumulate in: fp64 where the device has it, else fp32."""
    accelerator = get_accelerator()
    supported = getattr(accelerator, "is_fp64_supported", lambda: True)()
    return torch.double if supported else torch.float


def is_builtin_type(obj):
    return type(obj).__module__ in ("builtins", "__builtin__")


def isinstance_namedtuple(obj: object) -> bool:
    """Whether ``obj`` is an instance of a ``namedtuple`` / ``typing.NamedTuple``."""
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def is_zero_param(parameter):
    """Whether ``parameter`` is a ZeRO-3 partitioned parameter (it carries ``ds_id``)."""
    return torch.is_tensor(parameter) and hasattr(parameter, "ds_id")


def apply_to_tensors_only(function, value, warning_msg_fn=None):
    """``function`` applied to every tensor of ``value``; containers are rebuilt with their own type (dicts are
    updated in place), other leaves returned as they are (``warning_msg_fn(leaf)``, if given, is logged once on
    rank 0 for the first non-builtin leaf). A result that lost a ZeRO-3 parameter's ``ds_*`` attributes gets
    ``ds_param_alias`` pointing back to it."""
    global warned
    if isinstance(value, (tuple, list)):
        mapped = [apply_to_tensors_only(function, v, warning_msg_fn) for v in value]
        return type(value)(*mapped) if isinstance_namedtuple(value) else type(value)(mapped)
    if isinstance(value, dict):
        for key in value.keys():
            value[key] = apply_to_tensors_only(function, value[key], warning_msg_fn)
        return value
    if isinstance(value, torch.Tensor):
        result = function(value)
        if is_zero_param(value) and not is_zero_param(result):
            result.ds_param_alias = value
        return result
    if not is_builtin_type(value) and warning_msg_fn is not None and not warned:
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning(warning_msg_fn(value))
        warned = True
    return value


def _device():
    return torch.device(get_accelerator().current_device_name())


def get_lst_from_rank0(lst: List[int]) -> List[int]:
    """Rank 0's ``lst`` on every rank (all ranks pass a list of the same length; a broadcast)."""
    values = torch.tensor(lst if dist.get_rank() == 0 else [-1] * len(lst), dtype=torch.long, device=_device())
    dist.broadcast(values, src=0)
    return [int(v) for v in values.cpu()]


def assert_ints_same_as_other_ranks(ints: List[int]) -> None:
    """Raise ``RuntimeError`` on a rank whose ``ints`` differ (in length or values) from rank 0's."""
    length = torch.tensor([len(ints) if dist.get_rank() == 0 else -1], dtype=torch.long, device=_device())
    dist.broadcast(length, src=0)
    if int(length) != len(ints):
        raise RuntimeError(f"Detected a disagreement on list length between rank0 and rank{dist.get_rank()}: "
                           f"rank0: {int(length)} rank{dist.get_rank()}: {len(ints)}")
    reference = get_lst_from_rank0(ints)
    if reference != list(ints):
        raise RuntimeError(f"Detected a disagreement on list contents between rank0 and rank{dist.get_rank()}: "
                           f"rank0: {reference} rank{dist.get_rank()}: {list(ints)}")


def get_mapping_to_flat_buffer(tensors: List[torch.Tensor]) -> List[Tuple[torch.Tensor, int, int]]:
    """``(tensor, offset, numel)`` of each tensor laid end to end in one flat buffer."""
    mapping, offset = [], 0
    for tensor in tensors:
        mapping.append((tensor, offset, tensor.numel()))
        offset += tensor.numel()
    return mapping


def defragment(tensors: List[torch.Tensor]) -> torch.Tensor:
    """Move ``tensors`` (one dtype, one device) into one new contiguous buffer on their device and make each
    tensor's ``.data`` a view of it; returns the buffer. The values pass through host memory so the device
    allocation of the old tensors is freed before the new buffer is made."""
    if len({t.dtype for t in tensors}) != 1 or len({t.device for t in tensors}) != 1:
        raise ValueError("defragment needs tensors of one dtype on one device")
    mapping = get_mapping_to_flat_buffer(tensors)
    device = tensors[0].device
    host = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device="cpu")
    for tensor, offset, numel in mapping:
        host.narrow(0, offset, numel).copy_(tensor.reshape(-1))
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
    gc.collect()
    get_accelerator().empty_cache()
    flat = host.to(device)
    for tensor, offset, numel in mapping:
        tensor.data = flat.narrow(0, offset, numel)
    return flat
