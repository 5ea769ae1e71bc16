# SPDX-License-Identifier: Apache-2.0
"""Moving an optimizer's state tensors between devices (upstream's ``deepspeed.runtime.zero.offload_states``).

* ``offload_optimizer_states(opt, device, pin_memory)`` replaces every tensor of ``opt.state`` with a copy
  on ``device`` (pinned host memory with ``pin_memory``); ``reload_optimizer_states(opt, device)`` moves them
  back and returns the replaced host tensors (keep them alive until a non-blocking copy has finished).
* ``offload_adam_states`` / ``reload_adam_states`` do the same for ``exp_avg`` and ``exp_avg_sq`` only (defined in
  :mod:`deepspeed.runtime.utils`, upstream's other home for them, so that module imports nothing of ZeRO).

* ``get_state_devices(engine, state)``: the devices the engine's tensors of one
  :class:`~deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum` kind live on now (after
  ``engine.offload_states()``: the host; see :mod:`deepspeed.runtime.engine_parts.states`).

``OffloadStateTypeEnum`` is defined in :mod:`~deepspeed.runtime.zero.offload_config` (where upstream's callers
import it from) and re-exported here.
"""

from typing import Set

import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import offload_adam_states, reload_adam_states  # noqa: F401 (upstream has them in both)
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum  # noqa: F401 (upstream imports it here too)


def _host_copy(tensor, device, pin_memory, non_blocking):
    if pin_memory and tensor.device.type != "cpu":
        buffer = get_accelerator().pin_memory(torch.empty_like(tensor, device="cpu"))
        buffer.copy_(tensor, non_blocking=non_blocking)
        return buffer
    return tensor.to(device, non_blocking=non_blocking)


def offload_optimizer_states(optimizer, device, pin_memory=False, non_blocking=False):
    """Move every tensor of ``optimizer.state`` to ``device`` (see the module docstring)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                state[key] = _host_copy(value, device, pin_memory, non_blocking)


def reload_optimizer_states(optimizer, device, non_blocking=False):
    """Move every tensor of ``optimizer.state`` to ``device``; returns the tensors it replaced."""
    replaced = []
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                replaced.append(value)
                state[key] = value.to(device, non_blocking=non_blocking)
    return replaced


def unpin_offloaded_optimizer_states(optimizer):
    """Drop the page lock of pinned host tensors in ``optimizer.state`` (replaced by pageable copies)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.device.type == "cpu" and value.is_pinned():
                state[key] = value.clone()


def get_state_devices(model, state: OffloadStateTypeEnum) -> Set[torch.device]:
    """The devices ``model``'s (a DeepSpeed engine's) tensors of kind ``state`` live on now: the engine's device,
    the host (offloaded by ``engine.offload_states()``, or kept there by ``offload_optimizer`` /
    ``offload_param``), or both; the empty set when the engine holds none of that kind."""
    states = getattr(model, "_states", None)
    if states is None:
        raise TypeError(f"get_state_devices expects a DeepSpeed engine, got {type(model).__name__}")
    return states.devices(state)
