# SPDX-License-Identifier: Apache-2.0
"""Full and local views of a parameter's gradient, fp32 master and optimizer state.

These work on any parameter an engine owns, whatever the stage; for a parameter no
engine owns, the gradient is ``param.grad`` and the fp32 value is the parameter.
``safe_get_full_grad`` is meaningful after the boundary backward and before
``step()``: it returns the reduced, unscaled gradient (fp32 by default).
"""

import dataclasses

import torch

from deepspeed.runtime.backward.ownership import owner_of


def _stage(param):
    return owner_of(param)


def safe_get_full_grad(param):
    stage = _stage(param)
    if stage is None:
        return None if param.grad is None else param.grad.detach().clone()
    return stage.full_grad(param).detach().clone()


def safe_set_full_grad(param, value):
    stage = _stage(param)
    if stage is None:
        param.grad = value.detach().clone().to(param.dtype)
        return
    stage.set_full_grad(param, value)


def safe_get_full_fp32_param(param):
    stage = _stage(param)
    if stage is None:
        if hasattr(param, "ds_id"):  # a ZeRO-3 parameter no engine trains (frozen): gather it
            from deepspeed.runtime.zero.partition_parameters import GatheredParameters
            with GatheredParameters([param]):
                return param.detach().float().clone()
        return param.detach().float().clone()
    return stage.fp32_param(param).detach().float().clone()


def safe_set_full_fp32_param(param, value):
    stage = _stage(param)
    if stage is None:
        with torch.no_grad():
            param.copy_(value)
        return
    stage.set_fp32_param(param, value)


def safe_get_full_optimizer_state(param, optim_state_key):
    stage = _stage(param)
    if stage is None:
        return None
    value = stage.optimizer_state(param, optim_state_key)
    return None if value is None else value.detach().clone()


def safe_set_full_optimizer_state(param, value, optim_state_key):
    stage = _stage(param)
    if stage is None:
        raise ValueError("safe_set_full_optimizer_state: the parameter is not owned by a DeepSpeed engine")
    stage.set_optimizer_state(param, optim_state_key, value)


def safe_get_local_grad(param):
    """This rank's piece of the gradient (flat for partitioned stages; the whole tensor on stage 0)."""
    stage = _stage(param)
    if stage is None:
        return safe_get_full_grad(param)
    return stage.local_grad(param).detach().clone()


def safe_get_local_fp32_param(param):
    """This rank's piece of the fp32 parameter (flat for partitioned stages; the whole tensor on stage 0)."""
    stage = _stage(param)
    if stage is None:
        return safe_get_full_fp32_param(param)
    return stage.local_fp32_param(param).detach().clone()


# Setting through the full value works for every stage: each rank keeps its own piece.
safe_set_local_grad = safe_set_full_grad
safe_set_local_fp32_param = safe_set_full_fp32_param
safe_get_local_optimizer_state = safe_get_full_optimizer_state
safe_set_local_optimizer_state = safe_set_full_optimizer_state


def safe_update_full_grad_vectorized(param_list, update_func):
    """Replace each parameter's full gradient ``g`` by ``update_func(g, param)``.

    The gradient passed in, and the one written back, is the reduced, unscaled full gradient of
    :func:`safe_get_full_grad` (in the accumulation dtype, fp32 by default), so the update does not lose
    precision through the 16-bit model dtype. Call it on every rank with the same parameters, between the
    boundary backward and ``step()``, as the getters. Parameters without a gradient are left alone.
    """
    for param in param_list:
        grad = safe_get_full_grad(param)
        if grad is None:
            continue
        safe_set_full_grad(param, update_func(grad, param))


@dataclasses.dataclass
class fragment_address:  # noqa: N801 (upstream's name: its ZeRO 1/2 optimizer files pickle it)
    """Where a parameter's piece lies in a rank's flat partition: ``numel`` elements from ``start``."""
    numel: int
    start: int
