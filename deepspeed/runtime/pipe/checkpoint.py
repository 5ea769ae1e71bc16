# SPDX-License-Identifier: Apache-2.0
"""``save_checkpoint`` / ``load_checkpoint`` of a ``PipelineEngine``, in upstream's pipeline layout.

Layout of ``<dir>/<tag>/`` (upstream's names; docs/pipeline.md)::

    layer_XX-model_states.pt                   one layer's state dict (XX: its global index), whatever the cut
    mp_rank_SS_model_states.pt                 stage SS: ``module`` None, counters, scheduler, config, client state,
                                               ``param_shapes``, ZeRO-0's optimizer state (``optimizer``)
    [bf16_]zero_pp_rank_R_mp_rank_SS_optim_states.pt   ZeRO 1/2: data-parallel rank R's partition of stage SS

Each stage's ZeRO stage writes the files it writes for a data-parallel engine (``StageCheckpoint``), named for its
pipeline stage; the layer files are written by each stage's data-parallel rank 0 (or spread over the stage's
data-parallel ranks with ``checkpoint.parallel_write.pipeline_stage``).

Loading works for any cut, stage count and data-parallel size: every rank loads its layers from the layer files
(a tie from the first layer file that holds its module, then broadcast over the tie's stages), and builds the
optimizer state of its own parameters by name (``FullState``) from the saved stages that held them -- this
runtime's files, or upstream DeepSpeed 0.19's (ZeRO 1/2 files name their parameters; a ZeRO-0 file indexes them
in its stage's order, so it loads into the same cut only). Every step is checked on every rank and the ranks
agree before any state changes.
"""

import glob
import os
import uuid

import torch

from deepspeed.checkpoint import constants as C
from deepspeed.checkpoint.upstream_format import UpstreamCheckpoint
from deepspeed.runtime.checkpoint import model_state, paths
from deepspeed.runtime.checkpoint.optimizer_state import export_scaler, import_scaler
from deepspeed.runtime.checkpoint.reader import META_KEY, check_save_id, load_file, resolve_tag
from deepspeed.runtime.checkpoint.reshard import FullState, full_state_from_partitions
from deepspeed.runtime.checkpoint.saving import _copy_recovery_script, _local_checks
from deepspeed.runtime.checkpoint.stage_checkpoint import SaveContext, checkpoint_of
from deepspeed.runtime.checkpoint.validate import CheckpointError, agree, check_dir
from deepspeed.runtime.checkpoint.writer import SaveWriter
from deepspeed.runtime.configuration.tag_validation import resolve_tag as validate_tag
from deepspeed.utils.logging import logger

PIPELINE_KEY = "pipeline"


def model_states_name(stage):
    return f"{C.MODEL_FILE_PREFIX}{stage:02d}{C.MODEL_FILE_SUFFIX}"


def _staged(name, stage):
    """A data-parallel engine's file name, for pipeline stage ``stage`` (``mp_rank_00`` -> ``mp_rank_SS``)."""
    return name.replace(f"{C.MODEL_FILE_PREFIX}00", f"{C.MODEL_FILE_PREFIX}{stage:02d}")


# ---------------------------------------------------------------------------------------------------- saving
def _check_stage(engine, what):
    if engine.zero_optimization_stage() == 3:
        raise NotImplementedError(f"{what} of a pipeline engine with ZeRO stage 3 is not supported (the layer files "
                                  f"would need each layer's gathered parameters); use ZeRO 0-2 with pipeline "
                                  f"parallelism to checkpoint, see docs/pipeline.md")


def save(engine, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
    """Collective on every rank of every stage; returns True (see the module docstring)."""
    _check_stage(engine, "save_checkpoint")
    rank = engine.global_rank
    error = None
    try:
        save_dir, tag, client_state = _local_checks(engine, save_dir, tag, client_state)
    except Exception as exc:
        error = exc
    agreed = agree(error, (str(tag), uuid.uuid4().hex))
    tag = validate_tag([t for t, _ in agreed], rank, engine._config)
    save_id = agreed[0][1]
    writer = SaveWriter(engine.checkpoint_engine)  # the configured writer (synchronous: decoupled is refused)
    error = None
    try:
        _write_files(engine, writer, save_dir, tag, client_state, exclude_frozen_parameters, save_id)
    except Exception as exc:
        error = exc
    agree(error)
    error = None
    if rank == 0:
        try:
            if save_latest:
                writer.write_text(tag, paths.latest_path(save_dir))
            _copy_recovery_script(save_dir)
        except Exception as exc:
            error = exc
    agree(error)
    return True


def _write_files(engine, writer, save_dir, tag, client_state, exclude_frozen_parameters, save_id):
    module = engine.module
    stage_id = engine.stage_id
    directory = paths.tag_dir(save_dir, tag)
    os.makedirs(directory, exist_ok=True)
    pipeline_meta = dict(stages=engine.num_stages,
                         stage=stage_id,
                         chunks=module._chunks,
                         parts=list(module.parts),
                         layers=module._num_layers)

    def build_model_states(groups, meta, optimizer=None, module_entry=None, **_):
        states = model_state.build_model_states(engine,
                                                groups,
                                                exclude_frozen_parameters,
                                                meta,
                                                client_state,
                                                optimizer=optimizer,
                                                module={})
        states["module"] = None  # the weights are in the layer files
        states["mp_world_size"] = engine.num_stages * engine.grid.get_slice_parallel_world_size()
        states[C.CHECKPOINT_PARALLEL_DIMS] = {
            C.CHECKPOINT_PP_DEGREE: engine.num_stages,
            C.CHECKPOINT_TP_DEGREE: engine.grid.get_slice_parallel_world_size()
        }
        states[META_KEY] = dict(states[META_KEY])
        states[META_KEY][PIPELINE_KEY] = pipeline_meta
        if "optim_files" in states[META_KEY]:
            states[META_KEY]["optim_files"] = [_staged(n, stage_id) for n in states[META_KEY]["optim_files"]]
        return states

    save = SaveContext(name_of=model_state.param_names(module),
                       save_id=save_id,
                       dp_rank=engine.grid.get_data_parallel_rank(),
                       dp_world_size=engine.seq_dp_world_size,
                       bf16=bool(engine.bfloat16_enabled()),
                       fp16=bool(engine.fp16_enabled()),
                       exclude_frozen_parameters=exclude_frozen_parameters,
                       scaler=export_scaler(engine),
                       ds_config=engine.config,
                       build_model_states=build_model_states)
    for name, payload in checkpoint_of(engine).checkpoint_files(save):
        writer.save(payload, os.path.join(directory, _staged(name, stage_id)))
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    for name, state in module.layer_state_dicts(exclude_frozen_parameters):
        writer.save(clone_tensors_for_torch_save(state), os.path.join(directory, name))


def _tied_layers(module):
    """``{tie key: [indices of the layers that hold its module as themselves]}`` (those that have a layer file)."""
    from deepspeed.runtime.pipe.module import TiedLayerSpec
    out = {}
    for index, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec) and spec.forward_fn is None:
            out.setdefault(spec.key, []).append(index)
    return out


# ---------------------------------------------------------------------------------------------------- loading
class _SavedStages:
    """The model-states files of a saved pipeline tag, and each saved stage's optimizer state by name."""

    def __init__(self, directory, universal=False):
        self.directory = directory
        self.universal = universal
        self.files = sorted(glob.glob(os.path.join(directory, f"{C.MODEL_FILE_PREFIX}*{C.MODEL_FILE_SUFFIX}")))
        if not self.files:
            raise CheckpointError(
                f"{directory}: no {C.MODEL_FILE_PREFIX}*{C.MODEL_FILE_SUFFIX} file; not a checkpoint")
        self.first = load_file(self.files[0], "the model states of pipeline stage 0")
        self.upstream = META_KEY not in self.first
        self.stages = len(self.files)
        self._states = {0: self.first}

    def states(self, stage):
        if stage not in self._states:
            self._states[stage] = load_file(os.path.join(self.directory, model_states_name(stage)),
                                            f"the model states of pipeline stage {stage}")
        return self._states[stage]

    def stage_of_zero(self, stage):
        states = self.states(stage)
        if not self.upstream:
            return int(states[META_KEY].get("zero_stage", 0))
        return 0 if states.get("optimizer") is not None else 1

    def names(self, stage):
        """The trainable parameter names saved stage ``stage`` holds (None: unknown, an upstream ZeRO-0 file)."""
        states = self.states(stage)
        shapes = states.get(C.PARAM_SHAPES)
        if shapes:
            return [n for group in shapes for n in group]
        opt = states.get("optimizer")
        if isinstance(opt, dict) and "param_names" in opt:
            return [n for group in opt["param_names"] for n in group if n is not None]
        return None

    def full_state(self, stage, with_state, layer_values, own_names, same_cut):
        """``(FullState, scaler payload)`` of saved stage ``stage``."""
        states = self.states(stage)
        path = os.path.join(self.directory, model_states_name(stage))
        if self.universal:  # one folder per parameter: read this rank's own by name
            from deepspeed.checkpoint.universal_checkpoint import UniversalCheckpoint
            shapes = {k: v for k, v in states.items() if k != C.PARAM_SHAPES}
            reader = UniversalCheckpoint(self.directory, shapes, path)
            names = [n for n in (self.names(stage) or []) if n in set(own_names)]
            full, _, scaler = reader.full_state(with_state, names)
            return full, scaler
        if self.upstream:
            return self._upstream(stage, states, path, with_state, layer_values, own_names, same_cut)
        meta = states[META_KEY]
        if meta.get("zero_stage", 0) == 0:
            saved = states.get("optimizer")
            if not isinstance(saved, dict) or "param_names" not in saved:
                raise CheckpointError(f"{path}: holds no optimizer state")
            full = _stage0_full(saved, layer_values, path)
            return full, saved
        files = [os.path.join(self.directory, n) for n in meta.get("optim_files") or []]
        payloads = []
        for rank, name in enumerate(files):
            payload = load_file(name, f"the optimizer partition of rank {rank} of pipeline stage {stage}", mmap=True)
            check_save_id(payload, name, meta.get("save_id"))
            payloads.append(payload["optimizer_state_dict"])
        return full_state_from_partitions(payloads, files, with_state=with_state), payloads[0]

    def _upstream(self, stage, states, path, with_state, layer_values, own_names, same_cut):
        reader = _UpstreamStage(self.directory, states, path, stage)
        if reader.stage == 0:
            if not same_cut:
                raise CheckpointError(f"{path}: an upstream ZeRO-0 pipeline checkpoint lists its optimizer state by "
                                      f"the position of each parameter in its stage; it loads into the same "
                                      f"{self.stages} stages only. Load with load_optimizer_states=False to load the "
                                      f"weights into another cut")
            reader.param_names = own_names
            reader.layer_values = layer_values
        full, _, scaler = reader.full_state(with_state, own_names)
        return full, scaler


class _UpstreamStage(UpstreamCheckpoint):
    """One stage of an upstream pipeline checkpoint, read with the data-parallel reader's rules."""

    def __init__(self, directory, states, path, stage):
        self.pipe_stage = stage
        self.param_names = None
        self.layer_values = {}
        super().__init__(directory, states, path)

    def _check_supported(self):
        pass  # layer files and the pipe x model world size are this reader's business

    def optim_files(self, check=True):
        stage = self.pipe_stage
        for prefix in ("", "bf16_"):
            files = [
                os.path.join(
                    self.directory, f"{prefix}{C.ZERO_FILE_PREFIX}{r}_{C.MODEL_FILE_PREFIX}{stage:02d}"
                    f"{C.OPTIM_FILE_SUFFIX}") for r in range(self.world_size)
            ]
            if os.path.exists(files[0]):
                for name in files:
                    if check and not os.path.exists(name):
                        raise CheckpointError(f"{name}: missing (the stage's 'dp_world_size' is {self.world_size})")
                return files
        if check and getattr(self, "stage", 1) != 0:
            raise CheckpointError(f"{self.directory}: no optimizer files of pipeline stage {stage}")
        return []

    def _module_param_names(self):
        return list(self.param_names)

    @property
    def checkpoint_module(self):
        return self.layer_values

    def _stage0(self, with_state, trainable_names):
        module, self.checkpoint = self.checkpoint, dict(self.checkpoint, module=self.layer_values)
        try:
            return super()._stage0(with_state, trainable_names)
        finally:
            self.checkpoint = module


def _stage0_full(saved, layer_values, path):
    """A FullState from this runtime's ZeRO-0 ``optimizer`` entry (fp32 models: values from the layer files)."""
    inner = saved["optimizer"]
    flat = [n for group in saved["param_names"] for n in group]
    masters = saved.get("fp32_master_weights")
    full = FullState(groups=[{
        k: v
        for k, v in g.items() if k != "params"
    } for g in inner["param_groups"]],
                     group_names=saved["param_names"])
    for name in flat:
        if name is None:
            continue
        value = masters.get(name) if masters is not None else layer_values.get(name)
        if value is not None:
            full.fp32[name] = value.float()
    for index, state in inner["state"].items():
        if index >= len(flat) or flat[index] is None:
            raise CheckpointError(f"{path}: optimizer state for parameter index {index}, which has no name")
        full.state[flat[index]] = state
    return full


def _merge(states):
    """One FullState from several stages' (a tie appears in each of its stages: the first is taken)."""
    merged = FullState()
    for full in states:
        for name, value in full.fp32.items():
            merged.fp32.setdefault(name, value)
        for name, value in full.state.items():
            merged.state.setdefault(name, value)
        if not merged.groups:
            merged.groups = list(full.groups)
        for g, names in enumerate(full.group_names):
            while len(merged.group_names) <= g:
                merged.group_names.append([])
            merged.group_names[g] += [n for n in names if n not in merged.group_names[g]]
    return merged


def _layer_values(module, directory):
    """``{parameter or buffer name of this module: saved value}`` from the layer files of this rank's layers."""
    values = {}
    for idx, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "state_dict"):
            continue
        files = module.ckpt_layer_path_list(directory, idx)
        if not files:
            raise CheckpointError(f"{directory}: no file for layer {module._layer_index(idx)} "
                                  f"(layer_{module._layer_index(idx):02d}-*model_states.pt)")
        state = load_file(files[0], f"the state of layer {module._layer_index(idx)}")
        prefix = _prefix_of(module, layer)
        for key, value in state.items():
            values.setdefault(prefix + key, value)
    return values


def _prefix_of(module, layer):
    for name, child in module.named_children():
        if child is layer:
            return name + "."
    for key, tied in module.tied_modules.items():
        if tied is layer:
            return f"tied_modules.{key}."
    raise CheckpointError("a layer of the pipeline module is registered under no name")


def load(engine,
         load_dir,
         tag=None,
         load_module_strict=True,
         load_optimizer_states=True,
         load_lr_scheduler_states=True,
         load_module_only=False,
         custom_load_fn=None):
    """Collective on every rank; ``(path of the model-states file read, client state)`` or ``(None, None)``."""
    _check_stage(engine, "load_checkpoint")
    if custom_load_fn is not None:
        raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported with pipeline parallelism "
                                  "(upstream refuses it too): the layers load from their own files")
    module = engine.module
    stage = checkpoint_of(engine)
    name_of = model_state.param_names(module)
    own_names = [name_of[p] for group in stage.param_groups() for p in group] if stage.has_optimizer else []
    plan = dict(tag=None, reason=None)
    universal = bool(getattr(engine._config, "load_universal_checkpoint", False))
    error = None
    try:
        load_dir = check_dir(load_dir, "load_checkpoint")
        plan["tag"], plan["reason"] = resolve_tag(load_dir, tag, latest=C.LATEST_UNIVERSAL_FILE if universal else None)
        if plan["tag"] is not None:
            directory = paths.tag_dir(load_dir, plan["tag"])
            saved = _SavedStages(directory, universal)
            values = _layer_values(module, directory)
            _check_layers(module, values, load_module_strict, directory)
            plan.update(saved=saved, values=values, directory=directory)
            with_optimizer = stage.has_optimizer and not load_module_only
            if with_optimizer:
                plan["apply"], plan["scaler"], plan["deferred"] = _prepare_optimizer(
                    engine, stage, saved, values, own_names, name_of, load_optimizer_states, directory)
    except Exception as exc:
        error = exc
    outcomes = agree(error, plan["tag"])
    if all(t is None for t in outcomes):
        logger.warning(f"load_checkpoint: nothing to load: {plan['reason']}")
        return None, None
    if len(set(outcomes)) > 1:
        raise CheckpointError(f"load_checkpoint: the ranks do not see the same checkpoint ({outcomes}); the "
                              f"checkpoint directory must be the same on every rank")
    saved = plan["saved"]
    engine.zero_grad()
    _load_module(module, plan["values"], load_module_strict)
    module._synchronize_tied_weights()
    if "apply" in plan:
        plan["apply"]()
        if not load_module_only:
            import_scaler(engine, plan["scaler"])
    elif stage.has_optimizer:
        stage.refresh_from_model()
    first = saved.first
    if not load_module_only:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and first.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(first["lr_scheduler"])
        engine.global_steps = int(first.get("global_steps", engine.global_steps))
        engine.global_samples = int(first.get("global_samples", engine.global_steps * engine.train_batch_size()))
        engine.skipped_steps = int(first.get("skipped_steps", engine.skipped_steps))
    client = model_state.client_state_of(first, load_optimizer_states, load_lr_scheduler_states, load_module_only,
                                         False)
    return saved.files[0], client


def _check_layers(module, values, strict, directory):
    """With ``strict``: every entry of this stage's module has a saved value, but tied ones, which a stage that
    uses the tie only through a ``forward_fn`` receives from the tie's first stage."""
    if not strict:
        return
    expected = {k for k in module.state_dict() if not k.startswith("tied_modules.")}
    missing = sorted(expected - set(values))
    if missing:
        raise CheckpointError(f"{directory}: the layer files lack {missing[:6]} of this stage's module "
                              f"(load_module_strict=True)")


@torch.no_grad()
def _load_module(module, values, strict):
    own = module.state_dict()
    module.load_state_dict({k: v for k, v in values.items() if k in own}, strict=False)  # checked before


def _prepare_optimizer(engine, stage, saved, values, own_names, name_of, load_optimizer_states, directory):
    """Read the saved stages holding this rank's parameters; returns ``(apply, scaler payload, deferred)``.

    ``deferred``: the tied weights whose value no file of this rank holds (a stage that uses the tie through a
    ``forward_fn``, with a checkpoint that keeps fp32 values in the layer files only); ``apply`` takes their values
    from the module, which the tie's first stage has broadcast by then.
    """
    params = {name: p for p, name in name_of.items()}
    values = dict(values)
    deferred = {}
    for name in own_names:
        if name not in values and name.startswith("tied_modules."):
            deferred[name] = values[name] = torch.zeros(params[name].shape, dtype=torch.float32)
    needed = set(own_names)
    same_cut = saved.stages == engine.num_stages
    sources = []
    scaler = None
    for j in range(saved.stages):
        names = saved.names(j)
        if names is None:  # an upstream ZeRO-0 file: only this rank's own stage, in the same cut
            if j != engine.stage_id or not same_cut:
                continue
        elif not needed.intersection(names):
            continue
        full, payload = saved.full_state(j, load_optimizer_states, values, own_names, same_cut
                                         and j == engine.stage_id)
        sources.append(full)
        if scaler is None or j == engine.stage_id:
            scaler = payload
    merged = _merge(sources)
    for name in own_names:  # an fp32 model's stage-0 values may live only in the layer files
        if name not in merged.fp32 and name in values:
            merged.fp32[name] = values[name].float()
    if not own_names:
        merged.groups = merged.groups or [{} for _ in stage.param_groups()]
    apply = stage.prepare_import(merged, load_optimizer_states, name_of, directory)  # checks it, on every rank
    if deferred:

        def apply_deferred():  # the placeholders get the broadcast values, then the stage cuts the state as usual
            with torch.no_grad():
                for name in deferred:
                    merged.fp32[name] = params[name].detach().float().clone()
            stage.prepare_import(merged, load_optimizer_states, name_of, directory)()

        return apply_deferred, scaler or {}, deferred
    return apply, scaler or {}, deferred


# ---------------------------------------------------------------------------------------------------- universal
def to_universal(input_folder, output_folder, inject_info=None):
    """Write the universal folder of the pipeline checkpoint tag ``input_folder`` (``ds_to_universal``): every
    trainable parameter's fp32 value and optimizer state by name, merged over the saved stages, with the layer
    and model-states files beside them. A PipelineEngine of any cut loads it with ``checkpoint.load_universal``."""
    import shutil
    from deepspeed.checkpoint.universal_checkpoint import universal_optimizer_state, write_universal
    saved = _SavedStages(input_folder)
    if saved.upstream and any(saved.names(j) is None for j in range(saved.stages)):
        raise NotImplementedError(f"{input_folder}: an upstream ZeRO-0 pipeline checkpoint names none of its "
                                  f"parameters in its optimizer state (upstream's converter refuses it too)")
    values = _named_layer_values(saved, input_folder)
    sources, scaler = [], None
    for j in range(saved.stages):
        names = saved.names(j) or []
        full, payload = saved.full_state(j, True, values, names, True)
        sources.append(full)
        scaler = payload if scaler is None else scaler
    merged = _merge(sources)
    if saved.upstream:
        from deepspeed.checkpoint.upstream_format import scaler_state
        scaler = scaler_state(scaler, False,
                              2) if "loss_scaler" in scaler and not isinstance(scaler.get("loss_scaler"),
                                                                               (dict, type(None))) else scaler
    os.makedirs(output_folder, exist_ok=True)
    zero = saved.stage_of_zero(0)
    write_universal(output_folder, merged, {},
                    universal_optimizer_state(scaler, zero, int(saved.first.get("dp_world_size") or 1)), saved.files,
                    inject_info)
    for path in sorted(glob.glob(os.path.join(input_folder, f"{C.LAYER_FILE_PREFIX}*"))):
        shutil.copy2(path, os.path.join(output_folder, os.path.basename(path)))


def _named_layer_values(saved, directory):
    """``{parameter name: value}`` from the layer files, by the names the saved stages use (``3.weight``; a tie's
    ``tied_modules.<key>.<attr>`` from the first layer file holding its module)."""
    tied = (saved.first.get(META_KEY) or {}).get(PIPELINE_KEY, {}).get("tied_layers", {})
    values = {}
    for path in sorted(glob.glob(os.path.join(directory, f"{C.LAYER_FILE_PREFIX}*"))):
        index = int(os.path.basename(path)[len(C.LAYER_FILE_PREFIX):].split("-")[0])
        state = load_file(path, f"the state of layer {index}")
        keys = [f"tied_modules.{key}." for key, layers in tied.items() if layers and layers[0] == index]
        for prefix in keys or [f"{index}."]:
            for attr, value in state.items():
                values.setdefault(prefix + attr, value)
    return values
