# SPDX-License-Identifier: Apache-2.0
"""When a step is skipped for a non-finite gradient, and what the user is told.

The decision (:func:`agreed_overflow`): a step is skipped when a gradient holds a NaN or an infinity on any rank
its gradients span, and every such rank decides the same. The engine's stages reach agreement through their
gradient norm, which is summed over the stage's reduction group (every rank of the mesh: an expert's
expert-parallel and expert-data-parallel groups lie inside it), so their verdict needs no further collective.
``deepspeed.runtime.utils.CheckOverflow``, which callers use on gradients that may not be reduced, max-reduces
its finding over :func:`overflow_groups`: the data-parallel group (sequence-data-parallel, which holds the
expert groups of MoE parameters) and the model-parallel group, of the ``mpu`` when one is given, else of the
mesh (``deepspeed.utils.groups``).

A boundary step whose global gradient norm is not finite is skipped on every rank (the verdict comes
from reduced gradients, so every rank reaches it): the weights, the optimizer state and the LR schedule
stay as they were, ``engine.was_step_applied()`` is False and ``engine.skipped_steps`` grows by one;
``global_steps`` and ``global_samples`` still advance, as upstream counts them.

Which engines check: fp16 always (an overflow is how its dynamic loss scale learns); bf16 when
``bf16.check_grad_overflow`` is true (the default); fp32 only when the user sets
``engine.optimizer.check_grad_overflow = True``, as upstream.

For fp16 an overflow is routine while the loss scale settles, so it is logged at info level; for bf16
and fp32 it means a NaN or an infinity reached the gradients, so it is a warning.
"""

import logging

import torch

from deepspeed.utils.logging import log_dist


def overflow_groups(mpu=None):
    """The process groups an overflow verdict must agree over (see the module docstring), without groups of one
    rank; only the world's group when one of them is the whole world. Empty without a process group."""
    import deepspeed.comm as dist
    from deepspeed.utils import groups as mesh
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return []
    if mpu is not None:
        found = mesh.mpu_groups(mpu)
        candidates = [found.get("sequence_data_parallel", found.get("data_parallel")), found.get("model_parallel")]
    else:
        candidates = [mesh._get_sequence_data_parallel_group(), mesh._get_model_parallel_group()]
    world, chosen = dist.get_world_size(), []
    for group in candidates:
        size = dist.get_world_size(group) if group is not None else 1
        if size == world:
            return [group]
        if size > 1:
            chosen.append(group)
    return chosen


def agreed_overflow(local, groups=()):
    """The skip decision: whether ``local`` (this rank's finding: a bool or a bool tensor, true when a gradient or
    a norm it read was not finite) is true here or on any rank of ``groups``. The finding is max-reduced over each
    group in turn, so every rank of their union decides the same; with no groups ``local`` must already be agreed
    (a norm reduced over every rank the gradients span)."""
    if not groups:
        return bool(local)
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    flag = torch.as_tensor(local, dtype=torch.float32).reshape(1).to(get_accelerator().current_device_name())
    for group in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def report_skipped_step(step, loss_scaler, grad_norm):
    """Log, on rank 0, that boundary step ``step`` (1-based) was skipped, and why.

    ``loss_scaler`` is the engine's scaler (dynamic for fp16), ``grad_norm`` the global gradient norm
    that was not finite (a float, or None when unknown).
    """
    norm = "" if grad_norm is None else f" (global gradient norm {grad_norm})"
    if getattr(loss_scaler, "dynamic", False):
        log_dist(
            f"step {step}: fp16 gradient overflow{norm}; the optimizer step is skipped and the loss scale is "
            f"now {loss_scaler.loss_scale}",
            ranks=[0])
        return
    log_dist(
        f"step {step}: non-finite gradient{norm}; the optimizer step is skipped on every rank (weights, "
        f"optimizer state and LR schedule unchanged). A NaN or an infinity reached the gradients: check the "
        f"loss and the data of this step.",
        ranks=[0],
        level=logging.WARNING)
