# SPDX-License-Identifier: Apache-2.0
"""Export and import of each ZeRO stage's training state (fp32 masters, inner optimizer, loss scaler).

Stage 0 keeps everything replicated: its state goes into the model-states file's
``optimizer`` entry (:func:`export_stage0`), written by rank 0. Stages 1 and 2 keep
a partition per rank: each rank writes its own optimizer file
(:func:`export_partitioned`), with the layout metadata resharding needs.

Import is split in two so that every error is found before any rank changes state:
``prepare_*`` checks the loaded data against this engine and returns an ``apply``
function; the engine's ranks agree that every ``prepare`` succeeded, then call
``apply`` (for stages 1/2 it ends with the all-gather that puts the fp32 masters
into the model, so every rank must call it).

Two ways in: from the same layout it was saved from (stage 1 or 2, same world size,
same buckets: each rank copies its own partition), or from a
:class:`~deepspeed.runtime.checkpoint.reshard.FullState` (anything else: other world
size, other stage, other bucket size), matched by parameter name.
"""

import torch

from deepspeed.runtime.checkpoint.reshard import (STEP_KEY, FullState, describe_layout, fill_partition,
                                                  merge_group_scalars)
from deepspeed.runtime.checkpoint.validate import CheckpointError


# ------------------------------------------------------------------ shared
def trainable_groups(engine):
    """Per inner param group, the trainable model parameters the stage steps (in the stage's order)."""
    stage = engine._stage
    if stage.stage == 0:
        model_of = _stage0_model_of(stage)
        return [[model_of.get(p, p) for p in group["params"] if model_of.get(p, p).requires_grad]
                for group in engine.basic_optimizer.param_groups]
    layout = stage.layout
    return [[p for p in layout.params if layout.slots[p].group == g] for g in range(layout.num_groups)]


def _stage0_model_of(stage):
    """Inner optimizer parameter (an fp32 master, or the model parameter itself) -> model parameter."""
    if stage.masters is None:
        return {}
    return dict(zip(stage.masters.masters, stage.masters.model_params))


def export_scaler(engine):
    scaler = engine.loss_scaler
    return dict(loss_scaler=scaler.state_dict(),
                dynamic_loss_scale=bool(scaler.dynamic),
                fp16=bool(engine.fp16_enabled()),
                overflow=bool(engine.optimizer.overflow),
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
    """CheckpointError unless ``full`` has an fp32 value of the right shape for every trainable parameter."""
    for group in groups:
        for param in group:
            name = name_of[param]
            value = full.fp32.get(name)
            if value is None:
                raise CheckpointError(f"{describe}: no fp32 value for parameter '{name}' of shape "
                                      f"{tuple(param.shape)}; the checkpoint is of a different model")
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(f"{describe}: parameter '{name}' has shape {tuple(value.shape)} in the "
                                      f"checkpoint but {tuple(param.shape)} in the model")
    if load_optimizer_states and len(full.groups) != len(inner.param_groups):
        raise CheckpointError(f"{describe}: the checkpoint's optimizer has {len(full.groups)} param groups, this "
                              f"engine's has {len(inner.param_groups)}")


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
        sd["param_groups"].append(_group_entry(full, g, ids))
    return sd


def _group_entry(full, g, ids):
    entry = {k: v for k, v in full.groups[g].items() if k != "params"}
    entry["params"] = ids
    return entry


# ----------------------------------------------------------------- stage 0
def export_stage0(engine, name_of):
    """The model-states ``optimizer`` entry of a stage-0 engine (its torch optimizer's state dict and more)."""
    stage = engine._stage
    inner = engine.basic_optimizer
    model_of = _stage0_model_of(stage)
    names = [[name_of.get(model_of.get(p, p)) for p in group["params"]] for group in inner.param_groups]
    masters = None
    if stage.masters is not None:
        masters = {name_of[p]: m.detach() for p, m in zip(stage.masters.model_params, stage.masters.masters)}
    exported = dict(zero_stage=0, optimizer=inner.state_dict(), param_names=names, fp32_master_weights=masters)
    exported.update(export_scaler(engine))
    return exported


def full_state_from_stage0(saved, module_state, trainable_names, describe):
    """A FullState from a stage-0 ``optimizer`` entry (and the saved module, for fp32 models)."""
    if not isinstance(saved, dict) or "param_names" not in saved or "optimizer" not in saved:
        raise CheckpointError(f"{describe}: the 'optimizer' entry was not written by this runtime's ZeRO stage 0; "
                              f"load with load_module_only=True (or load_optimizer_states=False)")
    inner_sd = saved["optimizer"]
    flat = [name for group in saved["param_names"] for name in group]
    state = {}
    for index, st in inner_sd["state"].items():
        if index >= len(flat) or flat[index] is None:
            raise CheckpointError(f"{describe}: optimizer state for parameter index {index}, which has no name")
        state[flat[index]] = st
    masters = saved.get("fp32_master_weights")
    fp32 = {}
    for name in trainable_names:
        value = masters.get(name) if masters is not None else module_state.get(name)
        if value is not None:
            fp32[name] = value.float() if value.dtype != torch.float32 else value
    groups = [{k: v for k, v in group.items() if k != "params"} for group in inner_sd["param_groups"]]
    return FullState(fp32=fp32, state=state, groups=groups, group_names=saved["param_names"])


def prepare_stage0(engine, full, load_optimizer_states, name_of):
    """Check ``full`` against this stage-0 engine; return the ``apply()`` that loads it."""
    stage = engine._stage
    inner = engine.basic_optimizer
    model_of = _stage0_model_of(stage)
    params = list(stage.params)
    sd = None
    if load_optimizer_states:
        sd = {"state": {}, "param_groups": []}
        index = 0
        for g, group in enumerate(inner.param_groups):
            ids = []
            for q in group["params"]:
                st = full.state.get(name_of.get(model_of.get(q, q)))
                if st:
                    sd["state"][index] = st
                ids.append(index)
                index += 1
            sd["param_groups"].append(_group_entry(full, g, ids))

    @torch.no_grad()
    def apply():
        for param in params:
            target = stage.masters.master_of(param) if stage.masters is not None else param
            target.copy_(full.fp32[name_of[param]])
        if stage.masters is not None:
            stage.masters.copy_to_model()
        if sd is not None:
            load_inner(inner, sd)

    return apply


def refresh_stage0(engine):
    """fp32 masters from the (just loaded) 16-bit model."""
    if engine._stage.masters is not None:
        engine._stage.masters.copy_from_model()


# -------------------------------------------------------------- stages 1/2
def export_partitioned(engine, name_of, save_id):
    """This rank's optimizer file of a stage 1/2 engine: its partitions, inner state, scaler and the layout."""
    import deepspeed
    stage = engine._stage
    state = dict(zero_stage=stage.stage,
                 base_optimizer_state=engine.basic_optimizer.state_dict(),
                 single_partition_of_fp32_groups=[m.detach() for m in stage.masters],
                 partition_count=stage.layout.world_size,
                 partition_layout=describe_layout(stage.layout, name_of),
                 ds_version=deepspeed.__version__)
    extra = stage.extra_state()  # ZenFlow's window, selection and device part
    if extra is not None:
        state["stage_extra_state"] = extra
    state.update(export_scaler(engine))
    return dict(optimizer_state_dict=state, ds_config=engine.config, ds_version=deepspeed.__version__, save_id=save_id)


def layout_of(engine, name_of):
    return describe_layout(engine._stage.layout, name_of)


def prepare_partitioned_same_layout(engine, saved, load_optimizer_states, describe):
    """Load this rank's own partition, saved with the same layout; returns ``apply()`` (collective)."""
    stage = engine._stage
    parts = saved["single_partition_of_fp32_groups"]
    for g, (part, master) in enumerate(zip(parts, stage.masters)):
        if part.numel() != master.numel():
            raise CheckpointError(f"{describe}: the fp32 partition of param group {g} has {part.numel()} elements, "
                                  f"this rank's has {master.numel()}")
    inner_sd = saved["base_optimizer_state"]
    if load_optimizer_states and len(inner_sd["param_groups"]) != len(engine.basic_optimizer.param_groups):
        raise CheckpointError(f"{describe}: {len(inner_sd['param_groups'])} optimizer param groups, this engine's "
                              f"optimizer has {len(engine.basic_optimizer.param_groups)}")

    @torch.no_grad()
    def apply():
        for part, master in zip(parts, stage.masters):
            master.data.copy_(part)
        if load_optimizer_states:
            load_inner(engine.basic_optimizer, inner_sd)
        stage.all_gather_params()
        stage.load_extra_state(saved.get("stage_extra_state") if load_optimizer_states else None)

    return apply


def prepare_partitioned_full(engine, full, load_optimizer_states, name_of, describe):
    """Partition ``full`` into this rank's new layout; returns ``apply()`` (collective)."""
    stage = engine._stage
    layout = stage.layout
    inner = engine.basic_optimizer
    groups = trainable_groups(engine)
    masters = []
    for g, master in enumerate(stage.masters):
        part = torch.zeros(master.numel(), dtype=torch.float32)
        fill_partition(layout, groups[g], {p: full.fp32[name_of[p]] for p in groups[g]}, part)
        masters.append(part)
    sd = None
    if load_optimizer_states:
        sd = inner_state_dict(
            inner, full,
            lambda g: _partition_group_state(layout, groups[g], g, full, name_of, stage.masters[g].numel(), describe))

    @torch.no_grad()
    def apply():
        for part, master in zip(masters, stage.masters):
            master.data.copy_(part)
        if sd is not None:
            load_inner(inner, sd)
        stage.all_gather_params()
        stage.load_extra_state(None)  # another layout: ZenFlow starts a new selection and window

    return apply


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


def _partition_group_state(layout, params, g, full, name_of, numel, describe):
    """The inner state of group ``g``'s flat master on this rank, from per-parameter full state."""
    split = split_group_state(params, [p.shape for p in params], full, name_of, g, describe)
    if split is None:
        return {}
    result, by_shape = split
    for key, values in by_shape.items():
        if len(values) != len(params):
            raise CheckpointError(f"{describe}: optimizer state '{key}' exists for only some parameters of param "
                                  f"group {g}")
        dtype = next(iter(values.values())).dtype
        part = torch.zeros(numel, dtype=dtype)
        fill_partition(layout, params, values, part)
        result[key] = part
    return result


@torch.no_grad()
def refresh_partitioned(engine):
    """fp32 master partitions from the (just loaded) model parameters."""
    stage = engine._stage
    layout = stage.layout
    for bucket in layout.buckets:
        master = stage.masters[bucket.group].data
        layout.bucket_part(master, bucket).copy_(layout.bucket_own_chunk_full(stage.flat_params, bucket))
