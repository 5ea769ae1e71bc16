# SPDX-License-Identifier: Apache-2.0
"""The model-states file (``mp_rank_00_model_states.pt``): what it holds, and checks of a loaded one.

Keys, as upstream: ``module`` (the module's state_dict, compact CPU copies),
``buffer_names``, ``optimizer`` (stage 0: see ``stage_state.export_stage0``; ZeRO:
None), ``param_shapes`` (per param group: name -> shape of the trainable
parameters), ``frozen_param_shapes`` (name -> shape of the frozen ones),
``shared_params`` (alias name -> name of the parameter it is tied to),
``lr_scheduler``, ``global_steps``, ``global_samples``, ``skipped_steps``,
``dp_world_size``, ``mp_world_size``, ``ds_config``, ``ds_version``; plus
``ds_checkpoint_meta`` (how this runtime wrote the checkpoint) and the client state.
"""

from collections import OrderedDict

import torch

from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.checkpoint.reader import META_KEY
from deepspeed.runtime.checkpoint.validate import CheckpointError

# Keys that are not client state: ours and those upstream writes.
RESERVED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "lr_scheduler",
    "global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "frozen_param_fragments", "sparse_tensor_module_names", "csr_tensor_module_names", "data_sampler", "random_ltd",
    META_KEY
})


def param_names(module):
    """``{parameter: name}`` for the module's parameters (a tied parameter gets its first name)."""
    return {param: name for name, param in module.named_parameters()}


def shared_params(module):
    """``{alias: name}`` for each tied parameter's later names."""
    first = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param in first:
            aliases[name] = first[param]
        else:
            first[param] = name
    return aliases


def module_state_dict(module, exclude_frozen_parameters=False):
    """``module.state_dict()``, without the frozen parameters when asked (tensors still the live ones)."""
    state = module.state_dict()
    if exclude_frozen_parameters:
        for name, param in module.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                state.pop(name, None)
    return state


def buffer_names(module):
    persistent = set(module.state_dict().keys())
    return [name for name, _ in module.named_buffers() if name in persistent]


def frozen_param_shapes(module):
    return OrderedDict((name, param.shape) for name, param in module.named_parameters() if not param.requires_grad)


def param_shapes(groups, name_of):
    """Per param group: name -> shape of its trainable parameters (``groups``: lists of model parameters)."""
    return [OrderedDict((name_of[p], p.shape) for p in group) for group in groups]


def build_model_states(engine, groups, exclude_frozen_parameters, optimizer_state, meta, client_state):
    """The dict ``mp_rank_00_model_states.pt`` holds (tensors compacted to the CPU)."""
    import deepspeed
    name_of = param_names(engine.module)
    states = dict(
        module=clone_tensors_for_torch_save(module_state_dict(engine.module, exclude_frozen_parameters)),
        buffer_names=buffer_names(engine.module),
        optimizer=optimizer_state,
        param_shapes=param_shapes(groups, name_of),
        frozen_param_shapes=frozen_param_shapes(engine.module),
        shared_params=shared_params(engine.module),
        lr_scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        global_steps=engine.global_steps,
        global_samples=engine.global_samples,
        skipped_steps=engine.skipped_steps,
        dp_world_size=engine.dp_world_size,
        mp_world_size=engine.mp_world_size,
        ds_config=engine.config,
        ds_version=deepspeed.__version__,
    )
    states[META_KEY] = meta
    states.update(client_state)
    return states


def check_client_state(client_state):
    """ValueError unless ``client_state`` is a dict whose keys do not collide with the checkpoint's own keys."""
    if client_state is None:
        return {}
    if not isinstance(client_state, dict):
        raise ValueError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
    clash = sorted(str(k) for k in client_state if k in RESERVED_KEYS)
    if clash:
        raise ValueError(f"save_checkpoint: client_state keys {clash} are reserved for the checkpoint's own "
                         f"entries; rename them")
    return client_state


def client_state_of(checkpoint):
    return {key: value for key, value in checkpoint.items() if key not in RESERVED_KEYS}


def check_module(saved, module, strict, path):
    """CheckpointError naming the first parameter or buffer whose shape differs, or (strict) missing keys."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: 'module' is not a state dict")
    current = module.state_dict()
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    for name, tensor in saved.items():
        if name in current and torch.is_tensor(tensor) and tuple(tensor.shape) != tuple(current[name].shape):
            kind = "parameter" if name in params else "buffer"
            raise CheckpointError(f"{path}: {kind} '{name}' has shape {tuple(tensor.shape)} in the checkpoint but "
                                  f"{tuple(current[name].shape)} in the model; the checkpoint is of a different model")
    if strict:
        missing = [name for name in current if name not in saved]
        unexpected = [name for name in saved if name not in current]
        if missing or unexpected:
            raise CheckpointError(f"{path}: the checkpoint's module does not match the model "
                                  f"(load_module_strict=True): missing keys {missing}, unexpected keys {unexpected}")
