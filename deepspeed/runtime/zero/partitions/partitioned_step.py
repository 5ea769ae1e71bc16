# SPDX-License-Identifier: Apache-2.0
"""Master partitions (fp32, or 16-bit with ``*_master_weights_and_grads``) and the optimizer pointed at them, shared
by ZeRO stages 1, 2 and 3."""

import torch

from deepspeed.runtime.zero.offload.transfers import pinned


def master_partition(values, grad, pin_memory):
    """A master partition (an optimizer parameter) holding ``values``, in their dtype.

    Its ``.grad`` is ``grad`` (the window gradient partition) when that has the master's dtype and device;
    otherwise the stage attaches a copy in the master's dtype for each step (:func:`attach_step_grads`; ZenFlow,
    whose partitions may stay on the device, attaches its window's mean).
    """
    master = torch.nn.Parameter(pinned(values, pin_memory))
    if grad.dtype == master.dtype and grad.device == master.device:
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


def attach_step_grads(masters, grad_parts):
    """Give each master whose window gradient has another dtype a gradient in its own dtype for this step (the
    window gradient rounded once, :func:`attach_grad`); returns the masters it attached to (the stage drops their
    ``.grad`` after the step)."""
    attached = []
    for master, part in zip(masters, grad_parts):
        if part.dtype != master.dtype:
            attach_grad(master, part.to(master.dtype))
            attached.append(master)
    return attached


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
