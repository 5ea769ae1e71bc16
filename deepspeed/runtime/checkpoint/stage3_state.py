# SPDX-License-Identifier: Apache-2.0
"""Export and import of a ZeRO stage-3 engine's training state (per-rank parameter shards).

On stage 3 every parameter ``p`` is flattened, padded to ``W * s`` (``s`` its shard
size) and rank ``r`` owns elements ``[r*s, (r+1)*s)``. For param group ``g`` the
rank's fp32 master partition, and every optimizer state tensor shaped like it, hold
``p``'s shard at ``slots[p].part_offset``; frozen parameters' 16-bit shards live in the
stage's last source buffer. Each rank's optimizer file (:func:`export_zero3`) holds its
master partitions, the inner optimizer's state dict over them, the frozen shards
(unless excluded), the loss scaler and ``zero3_layout``: the world size and, per
parameter, its name, shape, numel, shard size, group and part offset.

Loading into the same layout copies the rank's own partitions. Any other world size
goes through :func:`full_state_from_zero3`: the shards of every saved rank,
concatenated and cut to ``numel``, give each parameter's full fp32 value and full
optimizer state; :func:`prepare_zero3_full` writes this rank's new shards.
As in :mod:`stage_state`, ``prepare_*`` only checks and returns an ``apply()``.
"""

import torch

from deepspeed.runtime.checkpoint.reshard import STEP_KEY, FullState
from deepspeed.runtime.checkpoint.stage_state import export_scaler, inner_state_dict, load_inner, split_group_state
from deepspeed.runtime.checkpoint.validate import CheckpointError

LAYOUT3_KEY = "zero3_layout"


def describe_zero3_layout(stage, name_of):
    """Plain-Python description of a stage-3 layout (rank included): what resharding needs."""
    layout = stage.layout
    params = []
    for name, param in _named_params(stage.module, name_of):
        slot = layout.slots[param]
        params.append(
            dict(name=name,
                 shape=list(param.ds_shape),
                 numel=int(param.ds_numel),
                 shard=slot.shard,
                 group=slot.group,
                 part_offset=slot.part_offset))
    return dict(world_size=layout.world_size,
                rank=layout.rank,
                num_groups=layout.num_groups,
                group_part_numel=list(layout.group_part_numel),
                frozen_part_numel=layout.frozen_part_numel,
                params=params)


def _named_params(module, name_of):
    return [(name_of[p], p) for p in module.parameters()]


def same_zero3_layout(a, b):
    keys = ("world_size", "num_groups", "group_part_numel", "frozen_part_numel", "params")
    return all(a.get(k) == b.get(k) for k in keys)


def export_zero3(engine, name_of, save_id, exclude_frozen_parameters):
    """This rank's optimizer file of a stage-3 engine."""
    import deepspeed
    stage = engine._stage
    frozen = None
    if not exclude_frozen_parameters and stage.layout.frozen_part_numel:
        frozen = stage.sources[len(stage.masters)].detach().cpu().clone()
    state = dict(zero_stage=3,
                 base_optimizer_state=engine.basic_optimizer.state_dict(),
                 fp32_flat_groups=[m.detach() for m in stage.masters],
                 frozen_16bit_shards=frozen,
                 partition_count=stage.layout.world_size)
    state[LAYOUT3_KEY] = describe_zero3_layout(stage, name_of)
    state.update(export_scaler(engine))
    return dict(optimizer_state_dict=state, ds_config=engine.config, ds_version=deepspeed.__version__, save_id=save_id)


def _full_value(parts, entry, dtype):
    """Concatenate every saved rank's shard of one parameter and cut it to its shape."""
    off, shard = entry["part_offset"], entry["shard"]
    flat = torch.cat([part.narrow(0, off, shard).to(dtype) for part in parts])
    return flat[:entry["numel"]].view(entry["shape"]).clone()


def _group_state(saved, g):
    sd = saved["base_optimizer_state"]
    indices = sd["param_groups"][g]["params"]
    return sd["state"].get(indices[0], {}) if indices else {}


def full_state_from_zero3(payloads, names, with_state=True):
    """``(FullState, frozen)`` from every saved rank's ``optimizer_state_dict`` (index = rank).

    ``frozen``: name -> full 16-bit value of each frozen parameter saved (empty when excluded).
    """
    layouts = [p.get(LAYOUT3_KEY) if isinstance(p, dict) else None for p in payloads]
    first = layouts[0]
    for layout, name in zip(layouts, names):
        if layout is None:
            raise CheckpointError(f"{name}: not a ZeRO stage 3 optimizer file of this runtime (no {LAYOUT3_KEY})")
        if layout["world_size"] != len(payloads) or not same_zero3_layout(layout, first):
            raise CheckpointError(f"{name}: its layout does not match the other ranks' files (world size "
                                  f"{layout['world_size']}, {len(payloads)} files)")
    num_groups = first["num_groups"]
    masters = [p["fp32_flat_groups"] for p in payloads]
    result = FullState()
    frozen = {}
    frozen_parts = [p.get("frozen_16bit_shards") for p in payloads]
    for entry in first["params"]:
        g = entry["group"]
        if g < num_groups:
            result.fp32[entry["name"]] = _full_value([m[g] for m in masters], entry, torch.float32)
        elif all(part is not None for part in frozen_parts):
            frozen[entry["name"]] = _full_value(frozen_parts, entry, frozen_parts[0].dtype)
    result.group_names = [[e["name"] for e in first["params"] if e["group"] == g] for g in range(num_groups)]
    if not with_state:
        return result, frozen
    saved_groups = payloads[0]["base_optimizer_state"]["param_groups"]
    if len(saved_groups) != num_groups:
        raise CheckpointError(f"{names[0]}: {len(saved_groups)} optimizer param groups for {num_groups} groups")
    result.groups = [{k: v for k, v in group.items() if k != "params"} for group in saved_groups]
    for g in range(num_groups):
        numel = first["group_part_numel"][g]
        entries = [e for e in first["params"] if e["group"] == g]
        for key, value in _group_state(payloads[0], g).items():
            partitioned = key != STEP_KEY and torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel
            for entry in entries:
                st = result.state.setdefault(entry["name"], {})
                if partitioned:
                    parts = []
                    for payload, name in zip(payloads, names):
                        part = _group_state(payload, g).get(key)
                        if not torch.is_tensor(part) or part.numel() != numel:
                            raise CheckpointError(f"{name}: optimizer state '{key}' of param group {g} is missing "
                                                  f"or not a partition of {numel} elements")
                        parts.append(part)
                    st[key] = _full_value(parts, entry, value.dtype)
                else:
                    st[key] = value.clone() if torch.is_tensor(value) else value
    return result, frozen


def check_zero3_full(engine, full, name_of, load_optimizer_states, describe):
    """CheckpointError unless ``full`` has a value of the right shape for every trainable parameter."""
    stage = engine._stage
    for param in stage.layout.params:
        name = name_of[param]
        value = full.fp32.get(name)
        if value is None:
            raise CheckpointError(f"{describe}: no fp32 value for parameter '{name}'; the checkpoint is of a "
                                  f"different model")
        if tuple(value.shape) != tuple(param.ds_shape):
            raise CheckpointError(f"{describe}: parameter '{name}' has shape {tuple(value.shape)} in the checkpoint "
                                  f"but {tuple(param.ds_shape)} in the model")
    if load_optimizer_states and len(full.groups) != len(engine.basic_optimizer.param_groups):
        raise CheckpointError(f"{describe}: the checkpoint's optimizer has {len(full.groups)} param groups, this "
                              f"engine's has {len(engine.basic_optimizer.param_groups)}")


def _write_shard(layout, param, value, out):
    """Write this rank's shard of the full ``value`` of ``param`` into ``out`` (a group partition); padding 0."""
    slot = layout.slots[param]
    start = layout.rank * slot.shard
    take = max(0, min(param.ds_numel - start, slot.shard))
    target = out.narrow(0, slot.part_offset, slot.shard)
    target.zero_()
    if take > 0:
        target[:take].copy_(value.reshape(-1)[start:start + take].to(out.dtype))


def _group_optimizer_state(engine, g, params, full, name_of, describe):
    stage = engine._stage
    split = split_group_state(params, [p.ds_shape for p in params], full, name_of, g, describe)
    if split is None:
        return {}
    result, tensors = split
    numel = stage.masters[g].numel()
    for key, values in tensors.items():
        if len(values) != len(params):
            raise CheckpointError(f"{describe}: optimizer state '{key}' exists for only some parameters of group {g}")
        part = torch.zeros(numel, dtype=next(iter(values.values())).dtype)
        for param, value in values.items():
            _write_shard(stage.layout, param, value, part)
        result[key] = part
    return result


def prepare_zero3_full(engine, full, frozen, load_optimizer_states, name_of, describe):
    """Cut ``full`` (and ``frozen``) into this rank's shards; returns ``apply()`` (collective)."""
    check_zero3_full(engine, full, name_of, load_optimizer_states, describe)
    stage = engine._stage
    layout = stage.layout
    inner = engine.basic_optimizer
    masters = [torch.zeros(m.numel(), dtype=torch.float32) for m in stage.masters]
    groups = [[p for p in layout.params if layout.slots[p].group == g] for g in range(layout.num_groups)]
    for g, params in enumerate(groups):
        for param in params:
            _write_shard(layout, param, full.fp32[name_of[param]], masters[g])
    frozen_params = [p for p in stage.module.parameters() if layout.slots[p].group >= len(stage.masters)]
    frozen_values = {p: frozen[name_of[p]] for p in frozen_params if name_of[p] in frozen}
    sd = None
    if load_optimizer_states:
        sd = inner_state_dict(inner, full,
                              lambda g: _group_optimizer_state(engine, g, groups[g], full, name_of, describe))

    @torch.no_grad()
    def apply():
        for part, master in zip(masters, stage.masters):
            master.data.copy_(part)
        frozen_part = stage.sources[len(stage.masters)]
        for param, value in frozen_values.items():
            _write_shard(layout, param, value, frozen_part)
        if sd is not None:
            load_inner(inner, sd)
        stage.refresh_16bit()

    return apply


def prepare_zero3_same_layout(engine, saved, load_optimizer_states, describe):
    """Copy this rank's own saved partitions (same layout); returns ``apply()`` (collective)."""
    stage = engine._stage
    parts = saved["fp32_flat_groups"]
    if len(parts) != len(stage.masters):
        raise CheckpointError(f"{describe}: {len(parts)} fp32 partitions, this engine has {len(stage.masters)}")
    inner_sd = saved["base_optimizer_state"]
    if load_optimizer_states and len(inner_sd["param_groups"]) != len(engine.basic_optimizer.param_groups):
        raise CheckpointError(f"{describe}: {len(inner_sd['param_groups'])} optimizer param groups, this engine's "
                              f"optimizer has {len(engine.basic_optimizer.param_groups)}")
    frozen = saved.get("frozen_16bit_shards")

    @torch.no_grad()
    def apply():
        for part, master in zip(parts, stage.masters):
            master.data.copy_(part)
        if frozen is not None:
            stage.sources[len(stage.masters)].copy_(frozen)
        if load_optimizer_states:
            load_inner(engine.basic_optimizer, inner_sd)
        stage.refresh_16bit()

    return apply


def check_zero3_module(ckpt, module, strict, path):
    """CheckpointError for a buffer of another shape or (strict) parameters/buffers missing or unexpected."""
    saved = ckpt.get("module") or {}
    buffers = dict(module.named_buffers())
    for name, tensor in saved.items():
        if name in buffers and torch.is_tensor(tensor) and tuple(tensor.shape) != tuple(buffers[name].shape):
            raise CheckpointError(f"{path}: buffer '{name}' has shape {tuple(tensor.shape)} in the checkpoint but "
                                  f"{tuple(buffers[name].shape)} in the model")
    shapes = {}
    for group in ckpt.get("param_shapes") or []:
        shapes.update(group)
    shapes.update(ckpt.get("frozen_param_shapes") or {})
    for name, param in module.named_parameters():
        if name in shapes and tuple(shapes[name]) != tuple(param.ds_shape):
            raise CheckpointError(f"{path}: parameter '{name}' has shape {tuple(shapes[name])} in the checkpoint but "
                                  f"{tuple(param.ds_shape)} in the model; the checkpoint is of a different model")
    if strict:
        persistent = set(module.state_dict().keys())
        expected_buffers = {name for name in buffers if name in persistent}
        params = {name for name, p in module.named_parameters() if p.requires_grad}
        missing = sorted((params - set(shapes)) | (expected_buffers - set(saved)))
        unexpected = sorted(set(saved) - expected_buffers)
        if missing or unexpected:
            raise CheckpointError(f"{path}: the checkpoint does not match the model (load_module_strict=True): "
                                  f"missing keys {missing}, unexpected keys {unexpected}")
