# SPDX-License-Identifier: Apache-2.0
"""The consolidated 16-bit state dict of a ZeRO-3 model (``engine._zero3_consolidated_16bit_state_dict``).

What the Transformers ``save_model`` and Accelerate ``get_state_dict`` receive, as
upstream builds it. A collective: every rank walks the module tree in the same order
(each module's own parameters, then its own buffers, then its children by
``named_children``) and takes part in gathering every parameter whole; rank 0 keeps
the values:

* parameters in the model's dtype, under every name the walk meets (a tied parameter
  appears under each of its names, all bound to one tensor); frozen ones are left out
  with ``exclude_frozen_parameters``;
* buffers except those registered ``persistent=False`` (``module._non_persistent_buffers_set``,
  e.g. a rotary embedding's ``inv_freq``).

Rank 0 gets an ``OrderedDict`` of fresh CPU tensors; every other rank gets None, as upstream.
"""

from collections import OrderedDict

import deepspeed.comm as dist


def consolidated_16bit_state_dict(module, stage, exclude_frozen_parameters=False):
    """See the module docstring; ``stage`` is the engine's ``StageCheckpoint`` (it gathers a parameter whole)."""
    return walk_whole_state(module, stage.full_16bit_value, exclude_frozen_parameters)


def walk_whole_state(module, whole_value, exclude_frozen_parameters=False):
    """The walk of the module docstring, with ``whole_value(param)`` (a collective every rank calls, in the walk's
    order) giving a parameter's whole value as rank 0 keeps it."""
    keep = not dist.is_initialized() or dist.get_rank() == 0
    state = OrderedDict() if keep else None
    first_name = {}  # parameter -> the name its tensor was stored under

    def visit(sub, prefix):
        for name, param in sub.named_parameters(recurse=False):
            if param is None or (exclude_frozen_parameters and not param.requires_grad):
                continue
            key = prefix + name
            if param in first_name:
                if keep:
                    state[key] = state[first_name[param]]
                continue
            value = whole_value(param)  # collective: every rank gathers
            first_name[param] = key
            if keep:
                state[key] = value
        if keep:
            for name, buf in sub.named_buffers(recurse=False):
                if buf is not None and name not in sub._non_persistent_buffers_set:
                    state[prefix + name] = buf.detach().cpu().clone()
        for name, child in sub.named_children():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(module, "")
    return state
