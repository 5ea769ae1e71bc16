# SPDX-License-Identifier: Apache-2.0
"""The inner optimizer's state and the loss scaler in a checkpoint, whatever the stage.

Every stage's checkpoint import goes through the same few steps, kept here:

* :func:`check_full_state`: a :class:`~deepspeed.runtime.checkpoint.reshard.FullState`
  (per-parameter fp32 values and optimizer state, by name) fits this engine's trainable
  parameters (full shapes) and param groups;
* :func:`split_group_state`: per-parameter state cut into what one flat master per param
  group needs (ZeRO 1-3): the tensors shaped like their parameter, and the scalars
  (``step``), which must agree within a group;
* :func:`inner_state_dict`, :func:`group_entry`: the inner optimizer's ``state_dict``
  rebuilt around this engine's own parameters, with the saved hyperparameters;
* :func:`load_inner`: ``load_state_dict`` that keeps the param-group dicts (LR schedulers
  hold them);
* :func:`export_scaler` / :func:`import_scaler`: the loss-scaler entries of a payload.
"""

import torch

from deepspeed.runtime.checkpoint.model_state import full_shape
from deepspeed.runtime.checkpoint.reshard import STEP_KEY, merge_group_scalars
from deepspeed.runtime.checkpoint.validate import CheckpointError


def export_scaler(engine):
    """The loss-scaler entries every optimizer payload carries (``loss_scaler``, ``overflow``, ...)."""
    scaler = engine.loss_scaler
    overflow = engine.optimizer.overflow if engine.optimizer is not None else False
    return dict(loss_scaler=scaler.state_dict(),
                dynamic_loss_scale=bool(scaler.dynamic),
                fp16=bool(engine.fp16_enabled()),
                overflow=bool(overflow),
                clip_grad=float(engine.gradient_clipping() or 0.0))


def import_scaler(engine, saved):
    """Restore the loss scaler when the checkpoint's is of the same kind (fp16 static/dynamic) as this engine's."""
    engine.optimizer.overflow = bool(saved.get("overflow", False))
    scaler_state = saved.get("loss_scaler")
    if not isinstance(scaler_state, dict):
        return
    same_kind = (bool(saved.get("fp16", engine.fp16_enabled())) == bool(engine.fp16_enabled())
                 and bool(saved.get("dynamic_loss_scale")) == bool(engine.loss_scaler.dynamic))
    if same_kind and engine.fp16_enabled():
        engine.loss_scaler.load_state_dict(scaler_state)


def load_inner(inner, state_dict):
    """``inner.load_state_dict`` that keeps the param-group dicts the same objects (schedulers hold them)."""
    before = list(inner.param_groups)
    inner.load_state_dict(state_dict)
    for index, (old, new) in enumerate(zip(before, inner.param_groups)):
        if old is not new:
            old.clear()
            old.update(new)
            inner.param_groups[index] = old


def check_full_state(full, groups, name_of, inner, load_optimizer_states, describe):
    """CheckpointError unless ``full`` has an fp32 value of the right shape for every trainable parameter.

    ``groups``: per param group, the trainable model parameters; shapes are full shapes
    (``ds_shape`` for a ZeRO-3 parameter).
    """
    for group in groups:
        for param in group:
            name = name_of[param]
            value = full.fp32.get(name)
            shape = full_shape(param)
            if value is None:
                raise CheckpointError(f"{describe}: no fp32 value for parameter '{name}' of shape {shape}; the "
                                      f"checkpoint is of a different model")
            if tuple(value.shape) != shape:
                raise CheckpointError(f"{describe}: parameter '{name}' has shape {tuple(value.shape)} in the "
                                      f"checkpoint but {shape} in the model")
    if load_optimizer_states and len(full.groups) != len(inner.param_groups):
        raise CheckpointError(f"{describe}: the checkpoint's optimizer has {len(full.groups)} param groups, this "
                              f"engine's has {len(inner.param_groups)}")


def group_entry(full, g, ids):
    """The ``param_groups`` entry of group ``g``: the saved hyperparameters, this engine's parameter indices."""
    entry = {k: v for k, v in full.groups[g].items() if k != "params"}
    entry["params"] = ids
    return entry


def inner_state_dict(inner, full, group_state):
    """The inner optimizer's state dict over one flat master per param group; ``group_state(g)`` gives group g's."""
    sd = {"state": {}, "param_groups": []}
    index = 0
    for g, group in enumerate(inner.param_groups):
        ids = []
        if group["params"]:
            state = group_state(g)
            if state:
                sd["state"][index] = state
            ids.append(index)
            index += 1
        sd["param_groups"].append(group_entry(full, g, ids))
    return sd


def split_group_state(params, shapes, full, name_of, g, describe):
    """Param group ``g``'s per-parameter full optimizer state, split for one flat master.

    Returns None when no parameter has state, else ``(scalars, tensors)``: the merged
    non-tensor entries (``step`` among them) and ``{key: {param: tensor}}`` for state
    shaped like its parameter (``shapes[i]`` is parameter i's full shape). A group
    with state for only some parameters raises.
    """
    states = [(name_of[p], full.state.get(name_of[p], {})) for p in params]
    with_state = [name for name, st in states if st]
    if not with_state:
        return None
    if len(with_state) != len(states):
        missing = [name for name, st in states if not st]
        raise CheckpointError(f"{describe}: parameters {missing} of param group {g} have no optimizer state while "
                              f"{with_state[:3]} do; one partitioned group needs all or none")
    tensors = {}
    scalars = []
    for (name, st), param, shape in zip(states, params, shapes):
        per_param = {}
        for key, value in st.items():
            if key != STEP_KEY and torch.is_tensor(value) and tuple(value.shape) == tuple(shape):
                tensors.setdefault(key, {})[param] = value
            else:
                per_param[key] = value
        scalars.append((name, per_param))
    return merge_group_scalars(scalars, g, describe), tensors


def flat_group_state(params, shapes, full, name_of, g, numel, describe, write):
    """The inner state of group ``g``'s flat master (``numel`` elements) on this rank, from per-parameter state.

    ``write(param, value, out)`` puts this rank's piece of ``param``'s full ``value`` into
    ``out`` (the flat partition); everything else of ``out`` stays zero.
    """
    split = split_group_state(params, shapes, full, name_of, g, describe)
    if split is None:
        return {}
    result, by_param = split
    for key, values in by_param.items():
        if len(values) != len(params):
            raise CheckpointError(f"{describe}: optimizer state '{key}' exists for only some parameters of param "
                                  f"group {g}")
        part = torch.zeros(numel, dtype=next(iter(values.values())).dtype)
        for param, value in values.items():
            write(param, value, part)
        result[key] = part
    return result
