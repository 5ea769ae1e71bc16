# SPDX-License-Identifier: Apache-2.0
"""Reading a checkpoint written by upstream DeepSpeed (0.16 to 0.19) into the stage-independent ``FullState``.

The facts of upstream's format this reader relies on (data-parallel world ``W``, files in
``<dir>/<tag>/``; docs/checkpoints.md, "Upstream's format"):

* **Stage 0.** ``mp_rank_00_model_states.pt`` holds the module and, in ``optimizer``, the
  optimizer's ``state_dict()``: for fp32 models the torch optimizer's own (state indexed by
  the position of each parameter in its param groups, in the model's parameter order); for
  16-bit models upstream's FP16 optimizer's, with ``optimizer_state_dict`` (the torch
  optimizer's, over the fp32 masters), the masters (``fp32_groups``: one tensor per
  parameter, or ``fp32_groups_flat``: one flat tensor per param group) and the loss-scale
  entries ``cur_scale``, ``cur_iter``, ``dynamic_loss_scale``, ``last_overflow_iter``.
* **Stages 1, 2.** The model-states file has ``param_shapes`` (per param group, name ->
  shape, in the group's order). Rank ``r``'s ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``
  holds, under ``optimizer_state_dict``: ``single_partition_of_fp32_groups`` (its partition of
  each group's flat fp32 space, the trailing alignment padding removed), ``base_optimizer_state``
  (the torch optimizer's state dict over the padded partitions; or, from an "elastic" save, a
  list of per-group states and ``base_optimizer_state_step``), ``group_paddings``,
  ``param_alignment_paddings``, ``param_slice_mappings`` (per group, name -> ``fragment_address``
  of the parameter's piece in this rank's partition), ``partition_count``, ``zero_stage``, and
  the loss scaler (a pickled ``LossScaler``/``DynamicLossScaler``), ``dynamic_loss_scale``,
  ``overflow``, ``clip_grad``. A group's flat space is its parameters in order, padded to a
  multiple of ``2 W``, cut into ``W`` equal partitions.
* **Stage 3.** Every rank writes ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (``module``:
  buffers, parameters as empty tensors; ``param_shapes``: per flat sub-group, name -> full
  shape; ``frozen_param_fragments``: the rank's shard of each frozen parameter) and its optimizer
  file: ``optimizer_state_dict`` with ``fp32_flat_groups`` (per sub-group, the concatenation of
  the rank's shard of each parameter: ``ceil(numel / W)`` elements, the last ranks' padded),
  ``optimizer_state_dict`` (the torch optimizer's, state ``i`` for sub-group ``i``),
  ``partition_count`` and the loss-scaler entries.

Every inconsistency raises :class:`~deepspeed.runtime.checkpoint.validate.CheckpointError` naming
the file and the key; what this package cannot map (pipeline or expert files, tensor
parallelism, optimizer state of another shape) raises NotImplementedError naming them.
"""

import glob
import math
import os

import torch

from deepspeed.checkpoint import constants as C
from deepspeed.checkpoint import upstream_autoep
from deepspeed.checkpoint.zero3_shards import join_zero3_shards
from deepspeed.runtime.checkpoint.reader import META_KEY, load_file
from deepspeed.runtime.checkpoint.reshard import STEP_KEY, FullState
from deepspeed.runtime.checkpoint.validate import CheckpointError

MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO3_MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
# the FP16 optimizer's loss-scale entries in a stage-0 ``optimizer``
_STAGE0_SCALE_KEYS = ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor",
                      "scale_window")


def is_upstream_model_states(checkpoint):
    """Whether a loaded model-states dict was written by upstream DeepSpeed (it lacks this package's meta entry)."""
    return isinstance(checkpoint, dict) and META_KEY not in checkpoint and "module" in checkpoint


def _numel(shape):
    return int(math.prod(tuple(shape)))


def scaler_state(saved, fp16, hysteresis):
    """The loss-scaler part of an upstream ZeRO optimizer-states dict ``saved`` (or a universal folder's
    ``optimizer_state``), as the stages' import takes it; a dynamic scaler's hysteresis counter, which upstream's
    files may lack, starts from the config's ``hysteresis``."""
    from deepspeed.runtime.fp16.loss_scaler import state_of
    state = state_of(saved.get(C.LOSS_SCALER))
    if state is not None and "cur_iter" in state:
        state.setdefault("cur_hysteresis", hysteresis)
    return dict(loss_scaler=state,
                dynamic_loss_scale=bool(saved.get("dynamic_loss_scale", False)),
                fp16=fp16,
                overflow=bool(saved.get("overflow", False)),
                clip_grad=float(saved.get(C.CLIP_GRAD, 0.0) or 0.0))


def module_values(model_states, per_rank):
    """name -> value of a model-states file's own module entries: the saved module, or with ``per_rank`` (ZeRO-3,
    whose parameters live in the optimizer files) only its buffers."""
    module = model_states["module"]
    if not per_rank:
        return dict(module)
    buffers = set(model_states.get(C.BUFFER_NAMES) or [])
    return {name: value for name, value in module.items() if name in buffers}


class UpstreamCheckpoint:
    """The upstream checkpoint in ``directory`` (a tag directory), described by its loaded ``model_states``.

    ``model_path`` is the file ``model_states`` came from (for messages). Nothing else is read
    until :meth:`full_state` is called.
    """

    def __init__(self, directory, model_states, model_path):
        self.directory = directory
        self.checkpoint = model_states
        self.model_path = model_path
        self._check_supported()
        self.per_rank = os.path.basename(model_path).startswith(C.ZERO_FILE_PREFIX)
        self.world_size = int(model_states.get("dp_world_size") or 1)
        config = model_states.get("ds_config") or {}
        self.fp16 = bool((config.get("fp16") or {}).get("enabled", False))
        self.bf16 = bool((config.get("bf16") or config.get("bfloat16") or {}).get("enabled", False))
        self.hysteresis = int((config.get("fp16") or {}).get("hysteresis", 2))
        self.stage = 3 if self.per_rank else self._replicated_stage()
        if upstream_autoep.is_autoep(model_states) and self.stage == 0:
            raise NotImplementedError(f"{model_path}: an upstream AutoEP checkpoint of ZeRO stage 0; stages 1-3 are "
                                      f"read (docs/moe.md)")

    # ------------------------------------------------------------ what it is
    def _check_supported(self):
        names = sorted(os.listdir(self.directory))
        autoep = upstream_autoep.is_autoep(self.checkpoint)
        for name in names:
            if autoep and upstream_autoep.EXPERT_FILE.fullmatch(name):
                continue  # upstream AutoEP's experts: read by upstream_autoep
            if name.startswith(C.LAYER_FILE_PREFIX) or "expert_" in name:
                kind = "pipeline-parallel layer" if name.startswith(C.LAYER_FILE_PREFIX) else "mixture-of-experts"
                raise NotImplementedError(f"{os.path.join(self.directory, name)}: a {kind} file of an upstream "
                                          f"checkpoint; this package cannot load such checkpoints")
        mp = int(self.checkpoint.get("mp_world_size") or 1)
        if mp != 1:
            raise NotImplementedError(f"{self.model_path}: 'mp_world_size' is {mp}; checkpoints of tensor- or "
                                      f"model-parallel runs cannot be loaded here")

    def _replicated_stage(self):
        files = self.optim_files(check=False)
        if files and os.path.exists(files[0]):
            saved = self._optimizer_state(files[0], 0)
            return int(saved.get(C.ZERO_STAGE, 1))
        return 0

    @property
    def has_optimizer(self):
        if self.stage == 0:
            return self.checkpoint.get("optimizer") is not None
        return True

    def optim_files(self, check=True):
        """Every saved rank's optimizer file (``bf16_`` prefixed when the save's were); [] on stage 0."""
        plain = [os.path.join(self.directory, OPTIM_STATES.format(rank=r)) for r in range(self.world_size)]
        bf16 = [os.path.join(self.directory, "bf16_" + OPTIM_STATES.format(rank=r)) for r in range(self.world_size)]
        if os.path.exists(bf16[0]) and not os.path.exists(plain[0]):
            files = bf16
        elif os.path.exists(plain[0]):
            files = plain
        else:
            if check and getattr(self, "stage", 1) != 0:
                raise CheckpointError(f"{plain[0]}: missing (the optimizer partition of rank 0 of this ZeRO stage "
                                      f"{self.stage} checkpoint; neither it nor its bf16_ form exists)")
            return []
        if check:
            for path in files:
                if not os.path.exists(path):
                    raise CheckpointError(f"{path}: missing (the checkpoint's 'dp_world_size' is "
                                          f"{self.world_size})")
        return files

    def _optimizer_state(self, path, rank):
        payload = load_file(path, f"the optimizer partition of rank {rank}", mmap=True)
        saved = payload.get(C.OPTIMIZER_STATE_DICT) if isinstance(payload, dict) else None
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path}: no '{C.OPTIMIZER_STATE_DICT}' entry; not a ZeRO optimizer file")
        return saved

    # ------------------------------------------------------------ the state
    def full_state(self, with_state=True, trainable_names=None):
        """``(FullState, frozen, scaler)``: every trainable parameter's fp32 value and optimizer state by name.

        ``frozen``: name -> full value of each frozen parameter a stage-3 checkpoint keeps
        (empty otherwise). ``scaler``: the loss-scaler entries in this package's form
        (``loss_scaler`` state dict, ``dynamic_loss_scale``, ``fp16``, ``overflow``,
        ``clip_grad``). ``trainable_names`` (stage 0): the names of the trainable
        parameters, for a saved optimizer that holds only those (the order is the saved module's).
        """
        if self.stage == 0:
            full, scaler = self._stage0(with_state, trainable_names)
            return full, {}, scaler
        if self.stage in (1, 2):
            full, scaler = self._partitioned(with_state)
            return full, {}, scaler
        return self._zero3(with_state)

    def _scaler(self, saved):
        return scaler_state(saved, self.fp16, self.hysteresis)

    # .............................................................. stage 0
    def _module_param_names(self):
        """The saved module's parameter names in order, one per tensor (tied names and buffers left out)."""
        module = self.checkpoint["module"]
        buffers = set(self.checkpoint.get(C.BUFFER_NAMES) or [])
        seen = set()
        names = []
        for name, value in module.items():
            if name in buffers or not torch.is_tensor(value):
                continue
            key = (value.untyped_storage().data_ptr(), value.storage_offset()) if value.numel() else None
            if key is not None and key in seen:
                continue
            seen.add(key)
            names.append(name)
        return names

    def _stage0(self, with_state, trainable_names):
        saved = self.checkpoint.get("optimizer")
        where = f"{self.model_path} ('optimizer')"
        if not isinstance(saved, dict):
            raise CheckpointError(f"{where}: holds no optimizer state")
        # The saved optimizer's parameters are the model's, in the model's order: all of them (a torch optimizer
        # built on ``model.parameters()``), or the trainable ones only (upstream's FP16 optimizers).
        names = self._module_param_names()
        module = self.checkpoint["module"]
        if "state" in saved and C.PARAM_GROUPS in saved:  # the torch optimizer's own (fp32 model)
            inner = saved
            masters = None
        elif C.OPTIMIZER_STATE_DICT in saved:  # upstream's FP16 optimizer (fp16 or bf16 model)
            inner = saved[C.OPTIMIZER_STATE_DICT]
            masters = saved.get(C.FP32_GROUPS)
            flat = saved.get("fp32_groups_flat")
            if masters is None and flat is None:
                raise CheckpointError(f"{where}: neither 'fp32_groups' nor 'fp32_groups_flat'")
        else:
            raise NotImplementedError(f"{where}: an optimizer state of keys {sorted(saved)[:8]} this package "
                                      f"cannot map")
        groups = inner[C.PARAM_GROUPS]
        count = sum(len(g["params"]) for g in groups)
        if count != len(names) and trainable_names is not None:
            trainable = set(trainable_names)
            names = [name for name in names if name in trainable]
        full = FullState(groups=[{k: v for k, v in g.items() if k != "params"} for g in groups])
        if masters is None and C.OPTIMIZER_STATE_DICT in saved:
            return self._stage0_fused(saved, inner, names, full, with_state)
        if count != len(names):
            raise CheckpointError(f"{where}: its param groups hold {count} parameters, the model has {len(names)} "
                                  f"({names[:4]}...); the checkpoint is of a different model or optimizer")
        index_name = {}
        position = 0
        for g, group in enumerate(groups):
            group_names = []
            for index in group["params"]:
                index_name[index] = names[position]
                group_names.append(names[position])
                position += 1
            full.group_names.append(group_names)
        flat_masters = [t for group in masters for t in group] if masters is not None else None
        for position, name in enumerate(names):
            value = flat_masters[position] if flat_masters is not None else module.get(name)
            if value is None:
                raise CheckpointError(f"{self.model_path}: no value for parameter '{name}' in 'module'")
            full.fp32[name] = value.detach().float().reshape(module[name].shape).clone() if name in module else \
                value.detach().float().clone()
        if with_state:
            for index, state in inner["state"].items():
                if index not in index_name:
                    raise CheckpointError(f"{where}: optimizer state for parameter index {index}, which no param "
                                          f"group lists")
                name = index_name[index]
                full.state[name] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in state.items()}
        return full, self._stage0_scaler(saved)

    def _stage0_fused(self, saved, inner, names, full, with_state):
        """The fused FP16 optimizer: one flat fp32 master (and state) per param group."""
        where = f"{self.model_path} ('optimizer')"
        module = self.checkpoint["module"]
        position = 0
        for g, flat in enumerate(saved["fp32_groups_flat"]):
            group_names = []
            taken = 0
            while taken < flat.numel():
                if position >= len(names):
                    raise CheckpointError(f"{where}: 'fp32_groups_flat'[{g}] has {flat.numel()} elements, more than "
                                          f"the model's parameters")
                group_names.append(names[position])
                taken += module[names[position]].numel()
                position += 1
            if taken != flat.numel():
                raise CheckpointError(f"{where}: 'fp32_groups_flat'[{g}] does not match the model's parameters")
            full.group_names.append(group_names)
            index = inner[C.PARAM_GROUPS][g]["params"][0]
            state = inner["state"].get(index, {}) if with_state else {}
            offset = 0
            for name in group_names:
                shape = module[name].shape
                n = _numel(shape)
                full.fp32[name] = flat.narrow(0, offset, n).float().view(shape).clone()
                entry = {}
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() == 1 and value.numel() == flat.numel():
                        entry[key] = value.narrow(0, offset, n).view(shape).clone()
                    elif torch.is_tensor(value) and value.dim() > 0:
                        raise NotImplementedError(f"{where}: optimizer state '{key}' of param group {g} has shape "
                                                  f"{tuple(value.shape)}, which this package cannot map")
                    else:
                        entry[key] = value.clone() if torch.is_tensor(value) else value
                if entry:
                    full.state[name] = entry
                offset += n
        return full, self._stage0_scaler(saved)

    def _stage0_scaler(self, saved):
        if "cur_scale" not in saved:
            return dict(loss_scaler=None, dynamic_loss_scale=False, fp16=self.fp16, overflow=False, clip_grad=0.0)
        dynamic = bool(saved.get("dynamic_loss_scale", False))
        state = {"cur_scale": float(saved["cur_scale"])}
        if dynamic:
            state.update(cur_iter=int(saved.get("cur_iter", 0)),
                         last_overflow_iter=int(saved.get("last_overflow_iter", -1)),
                         cur_hysteresis=self.hysteresis)
        return dict(loss_scaler=state,
                    dynamic_loss_scale=dynamic,
                    fp16=self.fp16,
                    overflow=False,
                    clip_grad=float(saved.get(C.CLIP_GRAD, 0.0) or 0.0))

    # .......................................................... stages 1, 2
    def _partitioned(self, with_state):
        shapes = self.checkpoint.get(C.PARAM_SHAPES)
        if not shapes:
            raise CheckpointError(f"{self.model_path}: no '{C.PARAM_SHAPES}' (needed to cut the ZeRO partitions)")
        files = self.optim_files()
        saved = [self._optimizer_state(path, rank) for rank, path in enumerate(files)]
        for rank, (osd, path) in enumerate(zip(saved, files)):
            parts = osd.get(C.SINGLE_PARTITION_OF_FP32_GROUPS)
            if not isinstance(parts, (list, tuple)) or len(parts) != len(shapes):
                raise CheckpointError(f"{path}: '{C.SINGLE_PARTITION_OF_FP32_GROUPS}' should hold {len(shapes)} "
                                      f"partitions (one per param group of '{C.PARAM_SHAPES}')")
        full = FullState(group_names=[list(group.keys()) for group in shapes])
        base0 = saved[0][C.BASE_OPTIMIZER_STATE]
        experts = {g for g in range(len(shapes)) if upstream_autoep.is_expert_group(base0, g)}
        for g in experts:  # upstream AutoEP's experts, in this package's names (experts stacked in global order)
            names, fp32, state = upstream_autoep.expert_group(self.checkpoint, saved, files, g, shapes[g],
                                                              self._group_state, with_state)
            full.group_names[g] = names
            full.fp32.update(fp32)
            full.state.update(state)
        for g, group in enumerate(shapes):
            if g in experts:
                continue
            pieces = self._piece_finder(saved, files, g, group)
            for name, shape in group.items():
                full.fp32[upstream_autoep.rename(name)] = pieces(lambda osd: osd[C.SINGLE_PARTITION_OF_FP32_GROUPS][g],
                                                                 name, shape,
                                                                 C.SINGLE_PARTITION_OF_FP32_GROUPS).float()
            full.group_names[g] = [upstream_autoep.rename(name) for name in group]
        scaler = self._scaler(saved[0])
        if not with_state:
            return full, scaler
        if isinstance(base0, dict):
            full.groups = [{k: v for k, v in group.items() if k != "params"} for group in base0[C.PARAM_GROUPS]]
        else:  # an elastic save keeps no hyperparameters: this engine's stay
            full.groups = [{} for _ in shapes]
        if len(full.groups) != len(shapes):
            raise CheckpointError(f"{files[0]}: {len(full.groups)} optimizer param groups for {len(shapes)} groups "
                                  f"of '{C.PARAM_SHAPES}'")
        for g, group in enumerate(shapes):
            if g in experts:
                continue
            pieces = self._piece_finder(saved, files, g, group)
            states = [self._group_state(osd, g, path) for osd, path in zip(saved, files)]
            for key, value in states[0].items():
                if key == STEP_KEY or not torch.is_tensor(value) or value.dim() == 0:
                    for name in group:
                        full.state.setdefault(upstream_autoep.rename(name),
                                              {})[key] = value.clone() if torch.is_tensor(value) else value
                    continue
                for rank, state in enumerate(states):
                    if not torch.is_tensor(state.get(key)) or state[key].dim() != 1:
                        raise NotImplementedError(f"{files[rank]}: optimizer state '{key}' of param group {g} is not "
                                                  f"a flat partition; this package cannot map it")
                for name, shape in group.items():
                    full.state.setdefault(upstream_autoep.rename(name),
                                          {})[key] = pieces(lambda osd, r=None: None,
                                                            name,
                                                            shape,
                                                            key,
                                                            states=[s[key] for s in states])
        return full, scaler

    @staticmethod
    def _group_state(osd, g, path):
        base = osd[C.BASE_OPTIMIZER_STATE]
        if isinstance(base, dict):
            indices = base[C.PARAM_GROUPS][g]["params"]
            state = dict(base["state"].get(indices[0], {})) if indices else {}
        else:
            state = dict(base[g])
            if C.BASE_OPTIMIZER_STATE_STEP in osd and STEP_KEY not in state:
                state[STEP_KEY] = osd[C.BASE_OPTIMIZER_STATE_STEP]
        return state

    def _piece_finder(self, saved, files, g, group):
        """``pieces(part_of, name, shape, key, states=None)``: the full value of ``name`` from every rank's partition.

        With ``param_slice_mappings`` each rank's piece is where the file says; without them
        (older saves) the pieces follow from the group's order and alignment paddings.
        """
        mappings = [osd.get(C.PARAM_SLICE_MAPPINGS) for osd in saved]
        offsets = None
        size = 0
        if any(m is None for m in mappings):
            offsets = {}
            position = 0
            paddings = saved[0].get(C.PARAM_ALIGNMENT_PADDINGS)
            for i, (name, shape) in enumerate(group.items()):
                offsets[name] = position
                position += _numel(shape) + (paddings[g][i] if paddings else 0)
            world = len(saved)
            size = int(math.ceil(position / (2 * world))) * 2  # each rank's share of the group padded to 2 W

        def pieces(part_of, name, shape, key, states=None):
            numel = _numel(shape)
            chunks = []
            if offsets is None:
                for rank, (osd, path) in enumerate(zip(saved, files)):
                    address = mappings[rank][g].get(name)
                    if address is None:
                        continue
                    part = states[rank] if states is not None else part_of(osd)
                    if address.start + address.numel > part.numel():
                        raise CheckpointError(f"{path}: '{C.PARAM_SLICE_MAPPINGS}' puts '{name}' past the end of "
                                              f"'{key}' of param group {g}")
                    chunks.append(part.narrow(0, address.start, address.numel))
            else:
                parts = states if states is not None else [part_of(osd) for osd in saved]
                start = offsets[name]
                for rank, part in enumerate(parts):
                    lo, hi = max(start, rank * size), min(start + numel, rank * size + part.numel())
                    if hi > lo:
                        chunks.append(part.narrow(0, lo - rank * size, hi - lo))
            value = torch.cat(chunks) if chunks else torch.zeros(0)
            if value.numel() != numel:
                raise CheckpointError(f"{files[0]}: the saved pieces of '{name}' in '{key}' of param group {g} hold "
                                      f"{value.numel()} elements, its shape {tuple(shape)} needs {numel}")
            return value.view(tuple(shape)).clone()

        return pieces

    # .............................................................. stage 3
    def _zero3(self, with_state):
        shapes = self.checkpoint.get(C.PARAM_SHAPES)
        if not shapes:
            raise CheckpointError(f"{self.model_path}: no '{C.PARAM_SHAPES}' (needed to cut the ZeRO-3 shards)")
        files = self.optim_files()
        world = len(files)
        saved = [self._optimizer_state(path, rank) for rank, path in enumerate(files)]
        flats = []
        for osd, path in zip(saved, files):
            groups = osd.get(C.FP32_FLAT_GROUPS)
            if not isinstance(groups, (list, tuple)) or len(groups) != len(shapes):
                raise CheckpointError(f"{path}: '{C.FP32_FLAT_GROUPS}' should hold {len(shapes)} flat groups (one per "
                                      f"entry of '{C.PARAM_SHAPES}')")
            flats.append(groups)

        def cut(parts, name, numel, offset, key):

            def too_short(rank):
                raise CheckpointError(f"{files[rank]}: '{key}' is too short for parameter '{name}'")

            return join_zero3_shards(parts, numel, offset, too_short)

        inner0 = saved[0].get(C.OPTIMIZER_STATE_DICT)
        if not isinstance(inner0, dict) or C.PARAM_GROUPS not in inner0:
            raise CheckpointError(f"{files[0]}: no torch optimizer state dict under "
                                  f"'{C.OPTIMIZER_STATE_DICT}.{C.OPTIMIZER_STATE_DICT}'")
        autoep = upstream_autoep.is_autoep(self.checkpoint)
        rename = upstream_autoep.rename if autoep else (lambda name: name)
        # upstream AutoEP's experts: sub-groups of its ``moe`` param groups, sharded over their expert-data-parallel
        # group; read in this package's names, every expert stacked in global order
        experts = {i for group in inner0[C.PARAM_GROUPS] if autoep and group.get("moe") for i in group["params"]}
        full = FullState()
        names_of = {}
        for i in sorted(experts):
            names, fp32, state = upstream_autoep.zero3_expert_group(self.checkpoint, saved, files, i, shapes[i],
                                                                    with_state)
            names_of[i] = names
            full.fp32.update(fp32)
            full.state.update(state)
        for i, group in enumerate(shapes):
            if i in experts:
                continue
            names_of[i] = [rename(name) for name in group]
            offset = 0
            for name, shape in group.items():
                numel = _numel(shape)
                value, shard = cut([f[i] for f in flats], name, numel, offset, C.FP32_FLAT_GROUPS)
                full.fp32[rename(name)] = value.float().view(tuple(shape)).clone()
                offset += shard
        frozen = self._zero3_frozen(world)
        for group in inner0[C.PARAM_GROUPS]:
            full.group_names.append([name for i in group["params"] for name in names_of[i]])
        scaler = self._scaler(saved[0])
        if not with_state:
            return full, frozen, scaler
        full.groups = [{k: v for k, v in group.items() if k != "params"} for group in inner0[C.PARAM_GROUPS]]
        for i, group in enumerate(shapes):
            if i in experts:
                continue
            states = [osd[C.OPTIMIZER_STATE_DICT]["state"].get(i, {}) for osd in saved]
            for key, value in states[0].items():
                if key == STEP_KEY or not torch.is_tensor(value) or value.dim() == 0:
                    for name in group:
                        full.state.setdefault(rename(name),
                                              {})[key] = value.clone() if torch.is_tensor(value) else value
                    continue
                if value.numel() != flats[0][i].numel():
                    raise NotImplementedError(f"{files[0]}: optimizer state '{key}' of sub-group {i} has "
                                              f"{value.numel()} elements, its fp32 group {flats[0][i].numel()}; this "
                                              f"package cannot map it")
                offset = 0
                for name, shape in group.items():
                    numel = _numel(shape)
                    piece, shard = cut([s[key] for s in states], name, numel, offset, key)
                    full.state.setdefault(rename(name), {})[key] = piece.view(tuple(shape)).clone()
                    offset += shard
        return full, frozen, scaler

    def _zero3_frozen(self, world):
        """name -> full value of each frozen parameter, from every rank's ``frozen_param_fragments``."""
        shapes = self.checkpoint.get(C.FROZEN_PARAM_SHAPES) or {}
        if not shapes:
            return {}
        fragments = []
        for rank in range(world):
            path = os.path.join(self.directory, ZERO3_MODEL_STATES.format(rank=rank))
            states = self.checkpoint if path == self.model_path else load_file(path, f"the model states of rank "
                                                                               f"{rank}")
            fragments.append(states.get(C.FROZEN_PARAM_FRAGMENTS) or {})
        frozen = {}
        for name, shape in shapes.items():
            if not all(name in f for f in fragments):
                continue  # saved with exclude_frozen_parameters
            flat = torch.cat([f[name].reshape(-1) for f in fragments])
            frozen[name] = flat[:_numel(shape)].view(tuple(shape)).clone()
        return frozen

    def module_values(self):
        """name -> value of the module's own entries: stages 0-2 the saved module, stage 3 its buffers (an AutoEP
        checkpoint's in this package's names, every expert stacked in global order)."""
        values = module_values(self.checkpoint, self.per_rank)
        if upstream_autoep.is_autoep(self.checkpoint):
            values = upstream_autoep.module_values(self.directory, self.checkpoint, values)
        return values

    def module_shapes(self):
        """``{name: shape}`` of :meth:`module_values` for an AutoEP checkpoint (renamed, experts added), else None."""
        if not upstream_autoep.is_autoep(self.checkpoint):
            return None
        shapes = {name: tuple(value.shape) for name, value in self.module_values().items() if torch.is_tensor(value)}
        if self.per_rank:  # ZeRO-3: the parameters are in the partitions; experts under this package's stacked names
            shapes.update((upstream_autoep.rename(name), tuple(shape))
                          for group in self.checkpoint.get(C.PARAM_SHAPES) or [] for name, shape in group.items())
            experts = upstream_autoep.expert_shapes(self.checkpoint)
            for prefix in {name.rsplit(".", 1)[0] for name in experts}:
                for w in ("w1", "w2", "w3"):
                    shapes.pop(f"{prefix}.{w}", None)
            shapes.update(experts)
        return shapes


def find_model_states(directory):
    """The path of the model-states file a reader of ``directory`` starts from (rank 0's on stage 3), or None."""
    replicated = os.path.join(directory, MODEL_STATES)
    if os.path.exists(replicated):
        return replicated
    rank0 = os.path.join(directory, ZERO3_MODEL_STATES.format(rank=0))
    if os.path.exists(rank0):
        return rank0
    found = sorted(glob.glob(os.path.join(directory, "*" + C.MODEL_FILE_SUFFIX)))
    return found[0] if found else None
