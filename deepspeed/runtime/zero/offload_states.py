# SPDX-License-Identifier: Apache-2.0
"""Moving an optimizer's state tensors between devices (upstream's ``deepspeed.runtime.zero.offload_states``).

* ``offload_optimizer_states(opt, device, pin_memory)`` replaces every tensor of ``opt.state`` with a copy
  on ``device`` (pinned host memory with ``pin_memory``); ``reload_optimizer_states(opt, device)`` moves them
  back and returns the replaced host tensors (keep them alive until a non-blocking copy has finished).
* ``offload_adam_states`` / ``reload_adam_states`` do the same for ``exp_avg`` and ``exp_avg_sq`` only, by
  moving ``.data`` through a persistent buffer kept in the state under ``<key>_offload_buffer``, so the
  state tensors stay the same objects.

Upstream's engine-level ``engine.offload_states()`` / ``reload_states()`` (moving a ZeRO-3 engine's
parameters, gradients and buffers off the device between steps) is not built here; ``get_state_devices``,
which inspects those engine states, raises ``NotImplementedError``.
"""

from enum import Enum
from typing import Set

import torch

from deepspeed.accelerator import get_accelerator


class OffloadStateTypeEnum(str, Enum):
    """The engine states upstream's ``engine.offload_states(include=...)`` names."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def _make_offload_state_key(key):
    return f"{key}_offload_buffer"


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


def offload_adam_states(optimizer, device, pin_memory: bool = False, non_blocking: bool = False):
    """Move ``exp_avg`` / ``exp_avg_sq`` of every state to ``device`` in place (through a kept buffer)."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                continue
            buffer_key = _make_offload_state_key(key)
            if buffer_key not in state:
                buffer = torch.empty_like(state[key], device=device)
                state[buffer_key] = get_accelerator().pin_memory(buffer) if pin_memory else buffer
            state[buffer_key].copy_(state[key], non_blocking=non_blocking)
            state[key].data = state[buffer_key]


def reload_adam_states(optimizer, device, non_blocking: bool = False):
    """Move ``exp_avg`` / ``exp_avg_sq`` back to ``device`` in place (after :func:`offload_adam_states`)."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key].data = state[_make_offload_state_key(key)].to(device, non_blocking=non_blocking)


def get_state_devices(model, state: OffloadStateTypeEnum) -> Set[torch.device]:
    """Upstream's device query of ``engine.offload_states``: not built here (see the module docstring)."""
    raise NotImplementedError("engine.offload_states() / reload_states() and get_state_devices are not built in "
                              "this runtime; see docs/compatibility.md")
