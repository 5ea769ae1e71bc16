# SPDX-License-Identifier: Apache-2.0
"""Writing a checkpoint in upstream DeepSpeed's format, so that upstream resumes it (the way back).

:func:`write_upstream_tag` takes the training state by parameter name (a ``FullState``: fp32
values, optimizer state, param-group hyperparameters), the module's own values and the
model-states entries, and writes the files upstream 0.19 writes for ZeRO stage ``zero_stage`` at
``world_size`` data-parallel ranks, with upstream's partition layouts (module docstring of
:mod:`deepspeed.checkpoint.upstream_format`): stage 0 the model-states file with the optimizer
state; stages 1-2 each group's parameters in order, flat, padded to a multiple of ``2 W``, in ``W``
equal partitions (``param_slice_mappings``, ``group_paddings``...); stage 3 each parameter in
``ceil(numel / W)`` shards, grouped by ``sub_group_size``. The loss scaler is pickled as upstream's
``deepspeed.runtime.fp16.loss_scaler`` classes; the ZeRO stage as ``ZeroStageEnum``.

:func:`convert_to_upstream` converts a checkpoint tag written by this package (any stage) into such
a tag; ``python -m deepspeed.checkpoint.upstream_writer --input_folder <dir>/<tag> --output_folder
<dir2>/<tag>`` runs it. The engine uses it for ``"checkpoint": {"save_format": "upstream"}``.

Upstream's optimizer at load time decides two details, which the config tells: with
``torch_adam`` (or a client torch optimizer) the torch optimizer's own state is written (``step`` a
tensor); with upstream's FusedAdam / DeepSpeedCPUAdam (``Adam``/``AdamW`` without ``torch_adam``)
``step`` is an int and the groups get ``bias_correction``, and a 16-bit stage-0 run uses upstream's
fused FP16 optimizer form (``fp32_groups_flat``) instead of the unfused one (``fp32_groups``).
"""

import argparse
import math
import os
import sys
from collections import OrderedDict

import torch

from deepspeed.checkpoint import constants as C
from deepspeed.checkpoint.upstream_format import MODEL_STATES, OPTIM_STATES, ZERO3_MODEL_STATES
from deepspeed.checkpoint.zero3_shards import zero3_shard_numel
from deepspeed.runtime.checkpoint.reshard import STEP_KEY
from deepspeed.runtime.checkpoint.validate import CheckpointError

# the model-states entries every upstream file has, besides the module and the optimizer
COMMON_KEYS = ("lr_scheduler", "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
               "ds_config", "ds_version")


def _upstream_fused_optimizer(ds_config):
    """Whether upstream steps this config's optimizer with its own FusedAdam / DeepSpeedCPUAdam."""
    optimizer = (ds_config or {}).get("optimizer") or {}
    kind = str(optimizer.get("type", "")).lower()
    return kind in ("adam", "adamw") and not (optimizer.get("params") or {}).get("torch_adam", False)


def _group_entry(hyper, indices, fused):
    entry = dict(hyper)
    if fused:
        entry.setdefault("bias_correction", True)
    entry["params"] = list(indices)
    return entry


def _state_entry(state, fused):
    out = {}
    for key, value in state.items():
        if key == STEP_KEY and fused:
            out[key] = int(value.item() if torch.is_tensor(value) else value)
        else:
            out[key] = value.detach().clone() if torch.is_tensor(value) else value
    return out


def _flat(values, names, numel, dtype=torch.float32):
    flat = torch.zeros(numel, dtype=dtype)
    offset = 0
    for name in names:
        value = values[name].reshape(-1)
        flat.narrow(0, offset, value.numel()).copy_(value)
        offset += value.numel()
    return flat


def _group_scalars(full, names, g):
    """The non-tensor state (``step``...) of group ``g``: every parameter's must agree (one flat tensor each)."""
    merged = {}
    for name in names:
        for key, value in (full.state.get(name) or {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                continue
            if key in merged and float(torch.as_tensor(merged[key])) != float(torch.as_tensor(value)):
                raise CheckpointError(f"optimizer state '{key}' differs between the parameters of param group {g}; "
                                      f"upstream's flat groups keep one value")
            merged.setdefault(key, value)
    return merged


def _tensor_keys(full, names):
    keys = []
    for name in names:
        for key, value in (full.state.get(name) or {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and key not in keys:
                keys.append(key)
    return keys


class UpstreamTag:
    """Everything one upstream tag directory is written from (see :func:`write_upstream_tag`)."""

    def __init__(self, full, module, entries, zero_stage, world_size, model_dtype, scaler, frozen=None):
        self.full = full
        self.module = module  # name -> value in the model's dtype (buffers, and the parameters on stages 0-2)
        self.entries = entries  # the other model-states entries (counters, scheduler, config, client state)
        self.stage = int(zero_stage)
        self.world = int(world_size)
        self.dtype = model_dtype
        self.scaler = scaler  # this package's scaler entries (loss_scaler state dict, dynamic_loss_scale, fp16...)
        self.frozen = frozen or {}
        self.fused = _upstream_fused_optimizer(entries.get("ds_config"))
        self.groups = [list(names) for names in full.group_names]
        for g, names in enumerate(self.groups):
            missing = [n for n in names if n not in full.fp32]
            if missing:
                raise CheckpointError(f"no fp32 value for parameters {missing[:4]} of param group {g}")

    # ------------------------------------------------------------ common parts
    def _scaler_object(self):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        state = self.scaler.get("loss_scaler") or {}
        fp16 = bool(self.scaler.get("fp16"))
        if not fp16:
            return LossScaler(1.0)
        if not self.scaler.get("dynamic_loss_scale"):
            return LossScaler(float(state.get("cur_scale", 1.0)))
        config = (self.entries.get("ds_config") or {}).get("fp16") or {}
        scaler = DynamicLossScaler(init_scale=float(state["cur_scale"]),
                                   scale_window=int(config.get("loss_scale_window", 1000)),
                                   min_scale=float(config.get("min_loss_scale", 1)),
                                   delayed_shift=int(config.get("hysteresis", 2)),
                                   consecutive_hysteresis=bool(config.get("consecutive_hysteresis", False)))
        scaler.cur_iter = int(state.get("cur_iter", 0))
        scaler.last_overflow_iter = int(state.get("last_overflow_iter", -1))
        scaler.cur_hysteresis = int(state.get("cur_hysteresis", scaler.delayed_shift))
        return scaler

    def _model_states(self, module, **fields):
        states = dict(module=module, buffer_names=list(self.entries.get("buffer_names") or []))
        states.update(fields)
        for key in COMMON_KEYS:
            states[key] = self.entries.get(key)
        states["dp_world_size"] = self.world
        states["mp_world_size"] = 1
        states[C.CHECKPOINT_PARALLEL_DIMS] = {C.CHECKPOINT_PP_DEGREE: 1, C.CHECKPOINT_TP_DEGREE: 1}
        if self.entries.get(C.UNIVERSAL_CHECKPOINT_INFO) is not None:
            states[C.UNIVERSAL_CHECKPOINT_INFO] = self.entries[C.UNIVERSAL_CHECKPOINT_INFO]
        states.setdefault("data_sampler", None)
        states.setdefault("random_ltd", None)
        for key, value in (self.entries.get("client_state") or {}).items():
            states.setdefault(key, value)
        return states

    def _optim_payload(self, optimizer_state_dict):
        return {
            C.OPTIMIZER_STATE_DICT: optimizer_state_dict,
            "ds_config": self.entries.get("ds_config"),
            C.DS_VERSION: self.entries.get("ds_version")
        }

    def _param_shapes(self, groups):
        return [OrderedDict((n, torch.Size(self.full.fp32[n].shape)) for n in names) for names in groups]

    def _optim_name(self, rank):
        return ("bf16_" if self.dtype == torch.bfloat16 else "") + OPTIM_STATES.format(rank=rank)

    # ----------------------------------------------------------------- stage 0
    def _stage0(self):
        if self.dtype == torch.float32:
            optimizer = self._per_parameter_state_dict()
        else:
            optimizer = self._stage0_16bit()
        module = OrderedDict(self.module)
        return [(MODEL_STATES,
                 self._model_states(module,
                                    optimizer=optimizer,
                                    param_shapes=None,
                                    frozen_param_shapes=None,
                                    shared_params=None,
                                    frozen_param_fragments=None))]

    def _per_parameter_state_dict(self):
        """A torch optimizer ``state_dict`` with one state entry per parameter, numbered across the groups."""
        full, fused = self.full, self.fused
        sd = {"state": {}, C.PARAM_GROUPS: []}
        index = 0
        for g, names in enumerate(self.groups):
            ids = []
            for name in names:
                if full.state.get(name):
                    sd["state"][index] = _state_entry(full.state[name], fused)
                ids.append(index)
                index += 1
            sd[C.PARAM_GROUPS].append(_group_entry(full.groups[g], ids, fused))
        return sd

    def _stage0_16bit(self):
        """Upstream's FP16 optimizer state: fused (one flat master per group) or unfused (one per parameter)."""
        full, fused = self.full, self.fused
        scale = self.scaler.get("loss_scaler") or {}
        fp16 = bool(self.scaler.get("fp16"))
        dynamic = bool(self.scaler.get("dynamic_loss_scale")) and fp16
        entry = {}
        if fp16 or not fused:  # the fused form writes the scale only when it scales
            entry["dynamic_loss_scale"] = dynamic
            entry["cur_scale"] = float(scale.get("cur_scale", 1.0)) if fp16 else 1.0
            entry["cur_iter"] = int(scale.get("cur_iter", 0))
            if dynamic:
                config = (self.entries.get("ds_config") or {}).get("fp16") or {}
                entry["last_overflow_iter"] = int(scale.get("last_overflow_iter", -1))
                entry["scale_factor"] = 2.0
                entry["scale_window"] = int(config.get("loss_scale_window", 1000))
        if fused:
            sd = {"state": {}, C.PARAM_GROUPS: []}
            flats = []
            for g, names in enumerate(self.groups):
                numel = sum(full.fp32[n].numel() for n in names)
                flats.append(_flat(full.fp32, names, numel))
                state = _group_scalars(full, names, g)
                for key in _tensor_keys(full, names):
                    state[key] = _flat({n: full.state[n][key] for n in names}, names, numel)
                if state:
                    sd["state"][g] = _state_entry(state, fused)
                sd[C.PARAM_GROUPS].append(_group_entry(full.groups[g], [g], fused))
            entry[C.OPTIMIZER_STATE_DICT] = sd
            entry["fp32_groups_flat"] = flats
            entry[C.CLIP_GRAD] = float(self.scaler.get("clip_grad", 0.0))
            return entry
        entry[C.OPTIMIZER_STATE_DICT] = self._per_parameter_state_dict()
        entry[C.FP32_GROUPS] = [[full.fp32[n].clone() for n in names] for names in self.groups]
        return entry

    # ------------------------------------------------------------ stages 1, 2
    def _partitioned(self):
        full, world, fused = self.full, self.world, self.fused
        files = []
        layouts = []
        for names in self.groups:
            total = sum(full.fp32[n].numel() for n in names)
            aligned = int(math.ceil(total / (2 * world))) * 2 * world
            layouts.append((names, total, aligned // world))
        scaler = self._scaler_object()
        for rank in range(world):
            fp32_parts, paddings, mappings, state, groups = [], [], [], {}, []
            for g, (names, total, part) in enumerate(layouts):
                lo, hi = rank * part, (rank + 1) * part
                flat = _flat(full.fp32, names, world * part)
                padding = max(0, min(part, hi - total))
                fp32_parts.append(flat[lo:hi - padding].clone())
                paddings.append(padding)
                mapping = OrderedDict()
                offset = 0
                for name in names:
                    numel = full.fp32[name].numel()
                    start, end = max(offset, lo), min(offset + numel, hi)
                    if end > start:
                        mapping[name] = _fragment(end - start, start - lo)
                    offset += numel
                mappings.append(mapping)
                group_state = _group_scalars(full, names, g)
                for key in _tensor_keys(full, names):
                    values = {n: full.state[n][key] for n in names}
                    group_state[key] = _flat(values, names, world * part)[lo:hi].clone()
                if group_state:
                    state[g] = _state_entry(group_state, fused)
                groups.append(_group_entry(full.groups[g], [g], fused))
            from deepspeed.runtime.zero.config import ZeroStageEnum
            osd = {
                C.LOSS_SCALER: scaler,
                "dynamic_loss_scale": bool(self.scaler.get("dynamic_loss_scale")) and bool(self.scaler.get("fp16")),
                "overflow": False,
                C.CLIP_GRAD: float(self.scaler.get("clip_grad", 0.0)),
                C.BASE_OPTIMIZER_STATE: {
                    "state": state,
                    C.PARAM_GROUPS: groups
                },
                C.SINGLE_PARTITION_OF_FP32_GROUPS: fp32_parts,
                C.ZERO_STAGE: ZeroStageEnum(self.stage),
                C.GROUP_PADDINGS: paddings,
                C.PARAM_ALIGNMENT_PADDINGS: [[0] * len(names) for names, _, _ in layouts],
                C.PARTITION_COUNT: [world] * len(layouts),
                C.DS_VERSION: self.entries.get("ds_version"),
                C.PARAM_SLICE_MAPPINGS: mappings,
            }
            files.append((self._optim_name(rank), self._optim_payload(osd)))
        frozen_shapes = OrderedDict((n, torch.Size(v.shape)) for n, v in self.frozen_values().items())
        states = self._model_states(OrderedDict(self.module),
                                    optimizer=None,
                                    param_shapes=self._param_shapes(self.groups),
                                    frozen_param_shapes=frozen_shapes if self.stage == 2 else None,
                                    shared_params=dict(self.entries.get("shared_params") or {}),
                                    frozen_param_fragments=self.frozen_values() if self.stage == 2 else None)
        return [(MODEL_STATES, states)] + files

    def frozen_values(self):
        """name -> full value of each frozen parameter (from the module, or the frozen values given)."""
        values = OrderedDict()
        trainable = {n for names in self.groups for n in names}
        buffers = set(self.entries.get("buffer_names") or [])
        shared = self.entries.get("shared_params") or {}
        for name, value in self.module.items():
            if name not in trainable and name not in buffers and name not in shared and value.numel() > 0:
                values[name] = value.detach().cpu().clone()
        for name, value in self.frozen.items():
            values.setdefault(name, value.detach().cpu().clone())
        return values

    # ----------------------------------------------------------------- stage 3
    def _sub_groups(self, names):
        """Upstream's sub-groups of one param group: parameters in order until their shards reach sub_group_size."""
        config = (self.entries.get("ds_config") or {}).get("zero_optimization") or {}
        limit = int(float(config.get("sub_group_size", 1e9)))
        shards = [zero3_shard_numel(self.full.fp32[n].numel(), self.world) for n in names]
        if limit >= sum(shards):
            return [list(names)]
        groups, current, size = [], [], 0
        for name, shard in zip(names, shards):
            current.append(name)
            size += shard
            if size >= limit or name == names[-1]:
                groups.append(current)
                current, size = [], 0
        return groups

    def _shards(self, values, names, rank, dtype=torch.float32):
        pieces = []
        for name in names:
            flat = values[name].reshape(-1)
            shard = zero3_shard_numel(flat.numel(), self.world)
            piece = torch.zeros(shard, dtype=dtype)
            take = max(0, min(shard, flat.numel() - rank * shard))
            if take:
                piece[:take].copy_(flat[rank * shard:rank * shard + take])
            pieces.append(piece)
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype)

    def _zero3(self):
        full, world, fused = self.full, self.world, self.fused
        sub_groups, owner = [], []
        for g, names in enumerate(self.groups):
            for sub in self._sub_groups(names):
                sub_groups.append(sub)
                owner.append(g)
        frozen = self.frozen_values()
        scaler = self._scaler_object()
        files = []
        from deepspeed.runtime.zero.config import ZeroStageEnum
        trainable = {n for names in self.groups for n in names}
        for rank in range(world):
            flats, state = [], {}
            for i, names in enumerate(sub_groups):
                flats.append(self._shards(full.fp32, names, rank))
                sub_state = _group_scalars(full, names, i)
                for key in _tensor_keys(full, names):
                    sub_state[key] = self._shards({n: full.state[n][key] for n in names}, names, rank)
                if sub_state:
                    state[i] = _state_entry(sub_state, fused)
            groups = [
                _group_entry(full.groups[g], [i for i, o in enumerate(owner) if o == g], fused)
                for g in range(len(self.groups))
            ]
            osd = {
                C.ZERO_STAGE: ZeroStageEnum.weights,
                C.LOSS_SCALER: scaler,
                "dynamic_loss_scale": bool(self.scaler.get("dynamic_loss_scale")) and bool(self.scaler.get("fp16")),
                "overflow": False,
                C.PARTITION_COUNT: world,
                C.OPTIMIZER_STATE_DICT: {
                    "state": state,
                    C.PARAM_GROUPS: groups
                },
                C.FP32_FLAT_GROUPS: flats,
            }
            module = OrderedDict()
            for name, value in self.module.items():
                if name in trainable or name in frozen:
                    module[name] = torch.empty(0, dtype=self.dtype)
                else:
                    module[name] = value
            fragments = OrderedDict((n, self._shards({n: v}, [n], rank, dtype=v.dtype)) for n, v in frozen.items())
            states = self._model_states(module,
                                        optimizer=None,
                                        param_shapes=self._param_shapes(sub_groups),
                                        frozen_param_shapes=OrderedDict(
                                            (n, torch.Size(v.shape)) for n, v in frozen.items()),
                                        shared_params=dict(self.entries.get("shared_params") or {}),
                                        frozen_param_fragments=fragments)
            files.append((ZERO3_MODEL_STATES.format(rank=rank), states))
            files.append((self._optim_name(rank), self._optim_payload(osd)))
        return files

    def files(self):
        """``[(file name, payload)]`` of the tag directory."""
        if self.stage == 0:
            return self._stage0()
        if self.stage in (1, 2):
            return self._partitioned()
        if self.stage == 3:
            return self._zero3()
        raise NotImplementedError(f"ZeRO stage {self.stage} has no upstream checkpoint layout")


def _fragment(numel, start):
    from deepspeed.utils.tensor_fragment import fragment_address
    return fragment_address(numel=numel, start=start)


def write_upstream_tag(tag_dir, tag):
    """Write every file of ``tag`` (an :class:`UpstreamTag`) into ``tag_dir`` (atomically, file by file)."""
    from deepspeed.runtime.checkpoint.writer import atomic_torch_save
    os.makedirs(tag_dir, exist_ok=True)
    for name, payload in tag.files():
        atomic_torch_save(payload, os.path.join(tag_dir, name))


# ------------------------------------------------------------------------ conversion
def _model_dtype(checkpoint, meta):
    config = checkpoint.get("ds_config") or {}
    if meta.get("bf16") or (config.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if meta.get("fp16") or (config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def upstream_tag_from_native(input_folder):
    """An :class:`UpstreamTag` from a checkpoint tag directory written by this package (any stage)."""
    from deepspeed.runtime.checkpoint.model_state import RESERVED_KEYS
    from deepspeed.runtime.checkpoint.reader import META_KEY
    from deepspeed.runtime.checkpoint.saved import SavedCheckpoint
    input_folder = os.path.abspath(input_folder)
    root, tag = os.path.dirname(input_folder), os.path.basename(input_folder)
    saved = SavedCheckpoint(root, tag, 0)
    if saved.reader is not None:
        raise ValueError(f"{saved.model_path}: already a checkpoint in upstream's format")
    ckpt = saved.checkpoint
    meta = saved.meta
    if not saved.has_optimizer:
        raise NotImplementedError(f"{saved.model_path}: a checkpoint without optimizer state; upstream's ZeRO "
                                  f"checkpoints need one")
    names = [n for group in ckpt.get("param_shapes") or [] for n in group]
    if saved.saved_stage == 0:
        full, scaler = saved.stage0_full_state(names)
        frozen = {}
    else:
        full, frozen, scaler = saved.full_state(True)
    module = saved.module_values(full, frozen) if saved.per_rank else dict(ckpt["module"])
    dtype = _model_dtype(ckpt, meta)
    order = list(meta.get("state_dict_keys") or ckpt["module"].keys())
    position = {name: i for i, name in enumerate(order)}
    full.group_names = [sorted(group, key=lambda n: position.get(n, len(position))) for group in full.group_names]
    ordered = OrderedDict()
    for name in order:
        if name in module:
            value = module[name]
            ordered[name] = value.to(dtype) if name in full.fp32 or name in frozen else value
    entries = {
        key: ckpt.get(key)
        for key in COMMON_KEYS + ("buffer_names", "shared_params", C.UNIVERSAL_CHECKPOINT_INFO)
    }
    entries["client_state"] = {k: v for k, v in ckpt.items() if k not in RESERVED_KEYS and k != META_KEY}
    return UpstreamTag(full, ordered, entries, saved.saved_stage, saved.world_size or 1, dtype, scaler, frozen)


def convert_to_upstream(input_folder, output_folder):
    """Convert this package's checkpoint tag ``input_folder`` into upstream's format in ``output_folder``."""
    if os.path.abspath(input_folder) == os.path.abspath(output_folder):
        raise ValueError("convert_to_upstream: the output folder must differ from the input folder (same file names)")
    write_upstream_tag(output_folder, upstream_tag_from_native(input_folder))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Convert a checkpoint tag of this package into upstream "
                                     "DeepSpeed's format (same stage and data-parallel world size)")
    parser.add_argument("--input_folder", required=True, help="the tag directory to convert, e.g. ckpt/global_step3")
    parser.add_argument("--output_folder", required=True, help="the tag directory to write")
    args = parser.parse_args(argv)
    convert_to_upstream(args.input_folder, args.output_folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
