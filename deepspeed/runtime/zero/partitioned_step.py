# SPDX-License-Identifier: Apache-2.0
"""fp32 master partitions and the optimizer pointed at them, shared by ZeRO stages 1, 2 and 3."""

import torch

from deepspeed.runtime.zero.transfers import pinned


def master_partition(values, grad, pin_memory):
    """An fp32 master partition (an optimizer parameter) holding ``values``.

    Its ``.grad`` is ``grad`` (the window gradient partition) when that is float32 and on the master's device;
    with a lower-precision window the stage attaches a float32 copy for each step instead (ZenFlow, whose
    partitions may stay on the device, attaches its window's mean).
    """
    master = torch.nn.Parameter(pinned(values, pin_memory))
    if grad.dtype == torch.float32 and grad.device == master.device:
        master.grad = grad
    return master


def attach_grad(master, grad):
    """``master.grad = grad`` (the partition's size), also while a disk tier keeps ``master.data`` empty: torch checks
    a gradient's size against the data it is assigned to, not the data against an existing gradient."""
    if grad is None or master.data.shape == grad.shape:
        master.grad = grad
        return
    data = master.data
    master.data = torch.empty(1, dtype=data.dtype, device=grad.device).expand(grad.shape)
    try:
        master.grad = grad
    finally:
        master.data = data


def point_optimizer_at(inner, masters, nonempty):
    """Make param group ``g`` of ``inner`` step ``masters[g]`` (the group dicts themselves are kept)."""
    for g, param_group in enumerate(inner.param_groups):
        param_group["params"] = [masters[g]] if nonempty[g] else []
    choose = getattr(inner, "_choose_kernel", None)
    if choose is not None:  # the fused/foreach choice depends on the parameters' device
        for param_group in inner.param_groups:
            choose(param_group)


class PartitionedOptimizerState:
    """``optimizer_state``/``set_optimizer_state`` for stages whose masters are one flat partition per group.

    The stage provides ``masters``, ``optimizer``, ``_masters_current()``, ``_group(param)``,
    ``_gather_from(buffer, param)`` (a
    collective: ``param``'s full fp32 value from every rank's group-partition-shaped ``buffer``) and
    ``_write(buffer, param, value)`` (this rank's piece of the full ``value`` into ``buffer``).
    """

    def optimizer_state(self, param, key):
        self._masters_current()
        master = self.masters[self._group(param)]
        value = self.optimizer.state.get(master, {}).get(key)
        if isinstance(value, torch.Tensor) and value.numel() == master.numel():
            return self._gather_from(value, param)
        return value

    def set_optimizer_state(self, param, key, value):
        self._masters_current()
        master = self.masters[self._group(param)]
        state = self.optimizer.state.get(master, {}).get(key)
        if not isinstance(state, torch.Tensor) or state.numel() != master.numel():
            raise KeyError(f"optimizer state '{key}' does not exist for this parameter yet")
        with torch.no_grad():
            self._write(state, param, value.to(state.dtype))
