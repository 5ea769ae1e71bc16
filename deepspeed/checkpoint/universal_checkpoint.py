# SPDX-License-Identifier: Apache-2.0
"""The universal checkpoint format: one folder per parameter, independent of stage and world size.

Upstream DeepSpeed's layout (facts of its format), which ``ds_to_universal`` writes and
``"checkpoint": {"load_universal": true}`` loads::

    <folder>/mp_rank_00_model_states.pt            the model states of the source (stages 0-2), or
    <folder>/zero_pp_rank_{r}_mp_rank_00_model_states.pt   those of every rank (stage 3)
    <folder>/zero/optimizer_state.pt               the optimizer's global state: param_groups, the loss scaler...
    <folder>/zero/<parameter name>/fp32.pt         {"param": full fp32 value, "cat_dim": 0}
    <folder>/zero/<parameter name>/exp_avg.pt      the same form, for each optimizer state tensor
    <folder>/zero/<parameter name>/exp_avg_sq.pt
    <folder>/zero/<parameter name>/step.pt         the step (a tensor or a number)
    <load_dir>/latest_universal                    the folder (tag) a load with tag=None reads

Upstream's converter writes stage-3 state files as bare flat tensors; both forms are read.
A model-states file carries ``universal_checkpoint_info`` (``{"universal_checkpoint_version": 0.4}``);
this package writes it in every checkpoint, upstream only when the client adds it, so converting an
upstream checkpoint needs ``--inject_missing_state``, as upstream's converter does.

:func:`write_universal` writes the folder from a ``FullState``; :class:`UniversalCheckpoint` reads
it back as one (the reader interface of :mod:`deepspeed.checkpoint.upstream_format`), which any
stage of this package cuts into its own layout at any world size.
"""

import os
import shutil

import torch

from deepspeed.checkpoint import constants as C
from deepspeed.checkpoint.upstream_format import module_values, scaler_state
from deepspeed.runtime.checkpoint.reader import load_file
from deepspeed.runtime.checkpoint.reshard import STEP_KEY, FullState
from deepspeed.runtime.checkpoint.validate import CheckpointError

FP32_FILE = C.FP32_WEIGHT_KEY + ".pt"
STEP_FILE = STEP_KEY + ".pt"


def universal_info():
    """The ``universal_checkpoint_info`` entry this package writes into its model-states files."""
    return {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE}


def _atomic_save(obj, path):
    from deepspeed.runtime.checkpoint.writer import atomic_torch_save
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_torch_save(obj, path)


def universal_optimizer_state(scaler, stage, world):
    """``zero/optimizer_state.pt`` besides the param groups: the loss scaler and the ZeRO bookkeeping, from a saved
    ``scaler`` payload, the saved ZeRO ``stage`` and its data-parallel ``world`` size."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    state = scaler.get("loss_scaler") or {}
    if scaler.get("fp16") and scaler.get("dynamic_loss_scale"):
        obj = DynamicLossScaler(init_scale=float(state.get("cur_scale", 1.0)))
        obj.cur_iter = int(state.get("cur_iter", 0))
        obj.last_overflow_iter = int(state.get("last_overflow_iter", -1))
        obj.cur_hysteresis = int(state.get("cur_hysteresis", obj.delayed_shift))
    else:
        obj = LossScaler(float(state.get("cur_scale", 1.0)) if scaler.get("fp16") else 1.0)
    return {
        C.LOSS_SCALER: obj,
        "dynamic_loss_scale": bool(scaler.get("dynamic_loss_scale")),
        "overflow": bool(scaler.get("overflow", False)),
        C.CLIP_GRAD: float(scaler.get("clip_grad", 0.0) or 0.0),
        C.ZERO_STAGE: int(stage),
        C.PARTITION_COUNT: int(world),
    }


def write_universal(output_folder, full, frozen, optimizer_state, model_files, inject_info=None, model_states=None):
    """Write the universal folder of a checkpoint (module docstring).

    ``full``: the ``FullState`` (fp32 values and optimizer state by name, param-group
    hyperparameters); ``frozen``: name -> value of the frozen parameters; ``optimizer_state``:
    what ``zero/optimizer_state.pt`` holds besides ``param_groups``; ``model_files``: the
    source's model-states files, copied into the folder (with ``inject_info`` added as
    ``universal_checkpoint_info`` when given); ``model_states``: instead of files, one model-states dict
    written as ``mp_rank_00_model_states.pt`` (a tensor-parallel source, its ranks' states merged).
    """
    zero = os.path.join(output_folder, C.UNIVERSAL_ZERO_FOLDER)
    for name, value in full.fp32.items():
        folder = os.path.join(zero, name)
        _atomic_save({C.PARAM: value.detach().float().clone(), C.CAT_DIM: 0}, os.path.join(folder, FP32_FILE))
        for key, state in (full.state.get(name) or {}).items():
            if key == STEP_KEY or not torch.is_tensor(state) or state.dim() == 0:
                _atomic_save(state, os.path.join(folder, f"{key}.pt"))
            else:
                _atomic_save({C.PARAM: state.detach().clone(), C.CAT_DIM: 0}, os.path.join(folder, f"{key}.pt"))
    for name, value in frozen.items():
        _atomic_save({C.PARAM: value.detach().float().clone(), C.CAT_DIM: 0}, os.path.join(zero, name, FP32_FILE))
    groups = [dict(group, params=[]) for group in full.groups]
    state = dict(optimizer_state)
    state[C.PARAM_GROUPS] = groups
    # upstream's stage-3 universal load reads the step and the hyperparameters from here
    first = next((st for st in full.state.values() if STEP_KEY in st), None)
    state[C.OPTIMIZER_STATE_DICT] = {
        "state": {
            0: {
                STEP_KEY: first[STEP_KEY]
            }
        } if first else {},
        C.PARAM_GROUPS: groups
    }
    _atomic_save(state, os.path.join(zero, C.UNIVERSAL_OPTIMIZER_STATE_FILE))
    if model_states is not None:
        _atomic_save(model_states, os.path.join(output_folder, "mp_rank_00_model_states.pt"))
    for path in model_files:
        target = os.path.join(output_folder, os.path.basename(path))
        if inject_info is None:
            shutil.copy2(path, target)
        else:
            states = load_file(path, "the model states")
            states[C.UNIVERSAL_CHECKPOINT_INFO] = inject_info
            _atomic_save(states, target)


def _tensor_of(obj, path):
    if isinstance(obj, dict):
        if C.PARAM not in obj:
            raise CheckpointError(f"{path}: no '{C.PARAM}' entry")
        return obj[C.PARAM]
    if torch.is_tensor(obj):
        return obj
    raise CheckpointError(f"{path}: neither a tensor nor a dict with '{C.PARAM}'")


class UniversalCheckpoint:
    """A universal folder (``directory``), with its loaded model states ``model_states`` from ``model_path``."""

    def __init__(self, directory, model_states, model_path):
        self.directory = directory
        self.checkpoint = model_states
        self.model_path = model_path
        self.zero = os.path.join(directory, C.UNIVERSAL_ZERO_FOLDER)
        state_path = os.path.join(self.zero, C.UNIVERSAL_OPTIMIZER_STATE_FILE)
        if not os.path.isdir(self.zero):
            raise CheckpointError(f"{self.zero}: missing; checkpoint.load_universal needs a folder written by "
                                  f"ds_to_universal (or load without load_universal)")
        self.optimizer_state = load_file(state_path, "the universal optimizer state")
        self.per_rank = os.path.basename(model_path).startswith(C.ZERO_FILE_PREFIX)
        self.world_size = int(model_states.get("dp_world_size") or 1)
        config = model_states.get("ds_config") or {}
        self.fp16 = bool((config.get("fp16") or {}).get("enabled", False))
        self.hysteresis = int((config.get("fp16") or {}).get("hysteresis", 2))
        stage = self.optimizer_state.get(C.ZERO_STAGE, (config.get("zero_optimization") or {}).get("stage", 0))
        # a universal folder is loaded by name whatever its source: the stage-0 path when the source had no ZeRO
        self.stage = 3 if self.per_rank else int(stage)
        self.has_optimizer = True

    def optim_files(self):
        return []

    def _trainable(self, trainable_names):
        shapes = self.checkpoint.get(C.PARAM_SHAPES)
        if shapes:
            return [name for group in shapes for name in group]
        if trainable_names is not None:
            return list(trainable_names)
        return sorted(n for n in os.listdir(self.zero) if os.path.isdir(os.path.join(self.zero, n)))

    def _load(self, name, key):
        path = os.path.join(self.zero, name, f"{key}.pt")
        return load_file(path, f"the universal '{key}' of '{name}'"), path

    def full_state(self, with_state=True, trainable_names=None):
        """``(FullState, frozen, scaler)``, as :meth:`UpstreamCheckpoint.full_state`."""
        names = self._trainable(trainable_names)
        full = FullState(group_names=[names])
        shapes = {}
        for group in self.checkpoint.get(C.PARAM_SHAPES) or []:
            shapes.update(group)
        for name in names:
            obj, path = self._load(name, C.FP32_WEIGHT_KEY)
            value = _tensor_of(obj, path).float()
            if name in shapes:
                value = value.reshape(tuple(shapes[name]))
            full.fp32[name] = value.clone()
        frozen = {}
        for name in (self.checkpoint.get(C.FROZEN_PARAM_SHAPES) or {}):
            path = os.path.join(self.zero, name, FP32_FILE)
            if os.path.exists(path):
                shape = tuple(self.checkpoint[C.FROZEN_PARAM_SHAPES][name])
                frozen[name] = _tensor_of(load_file(path, f"the universal fp32 of '{name}'"), path).reshape(shape)
        scaler = self._scaler()
        if not with_state:
            return full, frozen, scaler
        groups = self.optimizer_state.get(C.PARAM_GROUPS)
        if groups is None:
            raise CheckpointError(f"{os.path.join(self.zero, C.UNIVERSAL_OPTIMIZER_STATE_FILE)}: no "
                                  f"'{C.PARAM_GROUPS}'")
        full.groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        for name in names:
            folder = os.path.join(self.zero, name)
            state = {}
            for file in sorted(os.listdir(folder)):
                key, ext = os.path.splitext(file)
                if ext != ".pt" or key == C.FP32_WEIGHT_KEY:
                    continue
                obj, path = self._load(name, key)
                if key == STEP_KEY or not (isinstance(obj, dict) or torch.is_tensor(obj) and obj.dim() > 0):
                    state[key] = obj
                    continue
                value = _tensor_of(obj, path)
                if value.numel() != full.fp32[name].numel():
                    raise CheckpointError(f"{path}: {value.numel()} elements, the parameter '{name}' has "
                                          f"{full.fp32[name].numel()}")
                state[key] = value.reshape(full.fp32[name].shape).clone()
            if state and STEP_KEY not in state:
                first = (self.optimizer_state.get(C.OPTIMIZER_STATE_DICT) or {}).get("state", {}).get(0, {})
                if STEP_KEY in first:
                    state[STEP_KEY] = first[STEP_KEY]
            if state:
                full.state[name] = state
        return full, frozen, scaler

    def _scaler(self):
        return scaler_state(self.optimizer_state, self.fp16, self.hysteresis)

    def module_values(self):
        return module_values(self.checkpoint, self.per_rank)
