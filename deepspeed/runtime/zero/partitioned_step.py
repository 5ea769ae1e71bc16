# SPDX-License-Identifier: Apache-2.0
"""The boundary step over fp32 gradient partitions, shared by ZeRO stages 1, 2 and 3.

A stage using it has ``self.grads.grad_parts`` (one fp32 gradient partition per
optimizer param group, possibly on the CPU), ``self.group`` and ``self.device``.
The global norm sums every rank's partition with one all-reduce, so the overflow
verdict derived from it is the same on every rank.
"""

import torch

import deepspeed.comm as dist


def host_buffer(tensor, pin_memory):
    """``tensor``, page-locked if asked for, on the CPU and with a GPU to copy to."""
    if pin_memory and tensor.device.type == "cpu" and torch.cuda.is_available():
        return tensor.pin_memory()
    return tensor


def master_partition(values, grad, pin_memory):
    """An fp32 master partition (an optimizer parameter) holding ``values``, whose gradient is ``grad``."""
    master = torch.nn.Parameter(host_buffer(values, pin_memory))
    master.grad = grad
    return master


def point_optimizer_at(inner, masters, nonempty):
    """Make param group ``g`` of ``inner`` step ``masters[g]`` (the group dicts themselves are kept)."""
    for g, param_group in enumerate(inner.param_groups):
        param_group["params"] = [masters[g]] if nonempty[g] else []
    choose = getattr(inner, "_choose_kernel", None)
    if choose is not None:  # the fused/foreach choice depends on the parameters' device
        for param_group in inner.param_groups:
            choose(param_group)


class PartitionedStepMixin:

    _norm = None

    def finish_window(self):
        self._norm = None
        self.grads.finish_window()

    def global_grad_norm(self):
        if self._norm is None:
            sq = torch.zeros((), dtype=torch.float32, device=self.device)
            for part in self.grads.grad_parts:
                sq += torch.linalg.vector_norm(part, 2.0, dtype=torch.float32).to(self.device).square()
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                dist.all_reduce(sq, group=self.group)
            self._norm = sq.sqrt()
        return self._norm

    def found_overflow(self):
        return not bool(torch.isfinite(self.global_grad_norm()).item())

    def scale_grads(self, coef):
        for part in self.grads.grad_parts:
            part.mul_(coef.to(part.device))

    def zero_window(self):
        self._norm = None
        self.grads.zero_window()

    def release(self):
        self.grads.release()
