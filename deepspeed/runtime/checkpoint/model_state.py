# SPDX-License-Identifier: Apache-2.0
"""The model-states file: what it holds, the client state a load returns, and checks of a loaded module.

Keys, as upstream: ``module`` (the module's state_dict on the host, each tensor written as its own bytes and a
tied weight once; ZeRO-3: the persistent buffers only), ``buffer_names``, ``optimizer`` (stage 0: its optimizer state;
ZeRO: None), ``param_shapes`` (per param group: name -> full shape of the trainable
parameters), ``frozen_param_shapes`` (name -> full shape of the frozen ones),
``shared_params`` (alias name -> name of the parameter it is tied to), ``lr_scheduler``,
``global_steps``, ``global_samples``, ``skipped_steps``, ``dp_world_size``,
``mp_world_size``, ``ds_config``, ``ds_version``, ``universal_checkpoint_info``; plus
``ds_checkpoint_meta`` (how this runtime wrote the checkpoint) and the client state.

The client state ``load_checkpoint`` returns is upstream's: every entry of the
model-states file it read except those the load consumed (:func:`client_state_of`).
"""

import copy
from collections import OrderedDict

import torch

from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.checkpoint.universal_checkpoint import universal_info
from deepspeed.runtime.checkpoint.reader import META_KEY
from deepspeed.runtime.checkpoint.validate import CheckpointError

# Keys a client state may not use: ours and those upstream writes.
RESERVED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "lr_scheduler",
    "global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "frozen_param_fragments", "sparse_tensor_module_names", "csr_tensor_module_names", "data_sampler", "random_ltd",
    "checkpoint_parallel_dimensions", UNIVERSAL_CHECKPOINT_INFO, META_KEY, "tensor_parallel_layout",
    "tensor_parallel_size"
})
# What upstream's load removes from the returned dict: always the module; unless only the module is loaded, the
# counters and the world sizes it restored; the scheduler and the optimizer when it loaded them.
_CONSUMED_BY_FULL_LOAD = ("sparse_tensor_module_names", "skipped_steps", "global_steps", "dp_world_size",
                          "mp_world_size", "data_sampler", "random_ltd")


def full_shape(param):
    """The whole shape of ``param`` (a ZeRO-3 parameter's ``ds_shape``, whose data is only a shard)."""
    return tuple(getattr(param, "ds_shape", param.shape))


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


def host_tensors(state):
    """``state`` (a flat ``{name: tensor}`` mapping, its type kept) with every tensor detached on the host.

    A host tensor is taken as it is, not copied: the save writes it before training changes it (the decoupled
    writer first copies it into memory of its own), and the file writer cuts a view of a flat buffer to its own
    bytes (``checkpoint_engine/compaction.py``). A tensor on a device is copied to the host, once per view: names
    bound to one tensor (a tied weight) stay one tensor, written once and loaded tied, as ``module.state_dict()``
    gives them.
    """
    copies = {}

    def to_host(tensor):
        tensor = tensor.detach()
        if tensor.device.type == "cpu":
            return tensor
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr(), tensor.dtype, tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()))
        if key not in copies:
            copies[key] = tensor.to("cpu", copy=True)
        return copies[key]

    out = copy.copy(state)
    for name, value in state.items():
        if torch.is_tensor(value):
            out[name] = to_host(value)
    return out


def buffer_names(module):
    """The names of the module's persistent buffers (those ``state_dict()`` holds)."""
    persistent = set(module.state_dict().keys())
    return [name for name, _ in module.named_buffers() if name in persistent]


def persistent_buffers(module):
    """``{name: CPU copy}`` of the module's persistent buffers."""
    persistent = set(buffer_names(module))
    return {name: buf.detach().cpu().clone() for name, buf in module.named_buffers() if name in persistent}


def build_model_states(engine, groups, exclude_frozen_parameters, meta, client_state, optimizer=None, module=None):
    """The dict a model-states file holds (its module tensors on the host: :func:`host_tensors`).

    ``groups``: per param group, the trainable model parameters (``param_shapes``);
    ``optimizer``: the ``optimizer`` entry; ``module``: the ``module`` entry (default: the
    module's state dict).
    """
    import deepspeed
    name_of = param_names(engine.module)
    if module is None:
        module = host_tensors(module_state_dict(engine.module, exclude_frozen_parameters))
    states = dict(
        module=module,
        buffer_names=buffer_names(engine.module),
        optimizer=optimizer,
        param_shapes=[OrderedDict((name_of[p], torch.Size(full_shape(p))) for p in group) for group in groups],
        frozen_param_shapes=OrderedDict(
            (name, torch.Size(full_shape(p))) for name, p in engine.module.named_parameters() if not p.requires_grad),
        shared_params=shared_params(engine.module),
        lr_scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        global_steps=engine.global_steps,
        global_samples=engine.global_samples,
        skipped_steps=engine.skipped_steps,
        dp_world_size=engine.seq_dp_world_size,  # one file per rank of the partition group, as upstream
        mp_world_size=engine.mp_world_size,
        ds_config=engine.config,
        ds_version=deepspeed.__version__,
    )
    # what ds_to_universal requires of a model-states file (upstream writes it only when the client adds it)
    states[UNIVERSAL_CHECKPOINT_INFO] = universal_info()
    if engine.mp_world_size > 1:  # how each cut parameter is laid out over the tensor-parallel ranks
        from deepspeed.runtime.tensor_parallel.checkpoint import TP_LAYOUT_KEY, TP_SIZE_KEY, encode_layout
        states[TP_LAYOUT_KEY] = encode_layout(engine.module)
        states[TP_SIZE_KEY] = engine.mp_world_size
        states[UNIVERSAL_CHECKPOINT_INFO][TP_LAYOUT_KEY] = states[TP_LAYOUT_KEY]
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


def client_state_of(checkpoint, load_optimizer_states, load_lr_scheduler_states, load_module_only,
                    optimizer_from_model_states):
    """What ``load_checkpoint`` returns as client state, as upstream computes it from the same file.

    Every entry of ``checkpoint`` (the model-states dict) except ``module``; unless
    ``load_module_only``, also except the counters and world sizes; ``lr_scheduler`` when
    ``load_lr_scheduler_states``, ``optimizer`` when ``load_optimizer_states``. With
    ``optimizer_from_model_states`` (an engine without ZeRO partitions that restored its
    optimizer from this file, upstream's stage 0) ``optimizer`` is given back.
    """
    consumed = {"module"}
    if not load_module_only:
        consumed.update(_CONSUMED_BY_FULL_LOAD)
    if load_lr_scheduler_states:
        consumed.add("lr_scheduler")
    if load_optimizer_states:
        consumed.add("optimizer")
    state = {key: value for key, value in checkpoint.items() if key not in consumed}
    if optimizer_from_model_states:
        state["optimizer"] = checkpoint.get("optimizer")
    return state


def model_shapes(module):
    """``{state-dict name: full shape}`` of the module's parameters (every name of a tied one) and buffers."""
    shapes = {name: full_shape(p) for name, p in module.named_parameters(remove_duplicate=False)}
    for name, buf in module.named_buffers():
        shapes.setdefault(name, tuple(buf.shape))
    return shapes


def check_module(saved_shapes, module, strict, path):
    """CheckpointError naming the first parameter or buffer whose shape differs, or (strict) missing keys.

    ``saved_shapes``: ``{name: shape}`` of every entry the checkpoint has for the module.
    """
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    current = model_shapes(module)
    # a tensor-parallel parameter matches this rank's piece or the whole tensor (a universal folder's)
    whole = {
        name: tuple(p.ds_tp_layout.full_shape)
        for name, p in module.named_parameters(remove_duplicate=False) if hasattr(p, "ds_tp_layout")
    }
    for name, shape in saved_shapes.items():
        if name in current and tuple(shape) != current[name] and tuple(shape) != whole.get(name):
            kind = "parameter" if name in params else "buffer"
            raise CheckpointError(f"{path}: {kind} '{name}' has shape {tuple(shape)} in the checkpoint but "
                                  f"{current[name]} in the model; the checkpoint is of a different model")
    if strict:
        keys = list(module.state_dict().keys())
        missing = [name for name in keys if name not in saved_shapes]
        unexpected = [name for name in saved_shapes if name not in set(keys)]
        if missing or unexpected:
            raise CheckpointError(f"{path}: the checkpoint's module does not match the model "
                                  f"(load_module_strict=True): missing keys {missing}, unexpected keys {unexpected}")
