# SPDX-License-Identifier: Apache-2.0
"""``DeepSpeedConfig``: the parsed, validated DeepSpeed JSON config.

Construction validates everything up front and locally (no collectives), so a bad config raises the
same :class:`DeepSpeedConfigError` on every rank before any process group is used. Messages name the
full key path and the accepted values. The rules:

- An unresolved ``"auto"`` anywhere is an error (frameworks must fill those in first).
- Every known key is type- and range-checked; an unknown key inside a section raises and lists the
  valid keys; an unknown top-level key is logged and ignored, as upstream ignores it.
- Batch sizes satisfy ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps
  * world_size`` exactly; any two of them determine the third (see :func:`resolve_batch_sizes`).
"""

import dataclasses
import inspect
import json
import math
from typing import Any, Optional, Tuple

import torch

from .configuration.audit import audit_config
from .config_utils import (ConfigDict, ConfigSection, DeepSpeedConfigError, boolean, config_field, dtype, integer,
                           load_config, logger, mapping, number, one_of, optional, raise_on_auto_values,
                           drop_default_autos, section, size, string, string_list)
from .constants import (ACTIVATION_CHECKPOINTING, AIO, AMP, CHECKPOINT, CHECKPOINT_TAG_VALIDATION_MODES, COMET,
                        CSV_MONITOR, DATA_TYPES, DEEPSPEED_LR_SCHEDULES, DEEPSPEED_OPTIMIZERS, ELASTICITY,
                        GRADIENT_ALLREDUCE_OP_SUM, GRADIENT_ALLREDUCE_OP_SUPPORTED, KNOWN_TOP_LEVEL_KEYS,
                        MAX_GRAD_NORM, OPTIMIZER, SCHEDULER, SEQUENCE_PARALLEL_SIZE, TENSORBOARD, TORCH_AUTOCAST,
                        ValidationMode, WANDB)
from .precision.config import (DeepSpeedBF16Config, DeepSpeedFP16Config, bfloat16_section_name, get_bfloat16_config,
                               get_float16_config)
from .zero.config import DeepSpeedZeroConfig, ZeroStageEnum, get_zero_config
# Upstream's module also carries every key name and its raw-dict readers.
from .configuration.getters import *  # noqa: E402,F401,F403
from .constants import *  # noqa: E402,F401,F403

EIGENVALUE = "eigenvalue"

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "load_config", "resolve_batch_sizes"]


def _class_names(module, base) -> dict:
    """Public subclasses of ``base`` defined in ``module``, lower-cased name -> name."""
    return {
        name.lower(): name
        for name, obj in vars(module).items()
        if not name.startswith("_") and inspect.isclass(obj) and issubclass(obj, base) and obj is not base
    }


# torch.optim optimizers and torch.optim.lr_scheduler schedulers, usable by name as upstream allows.
TORCH_OPTIMIZERS = _class_names(torch.optim, torch.optim.Optimizer)
TORCH_LR_SCHEDULERS = _class_names(torch.optim.lr_scheduler, torch.optim.lr_scheduler.LRScheduler)

#########################################
# Small sections
#########################################


def _steps_per_print(value, path):
    """A positive int, or infinity (never print). ``null`` means never, as upstream's ``None``."""
    if value is None:
        return math.inf
    if isinstance(value, float) and value == math.inf:
        return value
    return integer(minimum=1)(value, path)


_ALLREDUCE_OPS = one_of(GRADIENT_ALLREDUCE_OP_SUPPORTED)


def _gradient_allreduce_op(value, path):
    try:
        return _ALLREDUCE_OPS(value, path)
    except DeepSpeedConfigError as err:  # upstream's words first: code matches on them
        raise DeepSpeedConfigError(f"Invalid gradient_allreduce_op: {err}") from None


@dataclasses.dataclass(frozen=True)
class _TopLevelSettings(ConfigSection):
    """The scalar top-level keys."""
    train_batch_size: Optional[int] = config_field(None, parse=optional(integer(minimum=1)))
    train_micro_batch_size_per_gpu: Optional[int] = config_field(None, parse=optional(integer(minimum=1)))
    gradient_accumulation_steps: Optional[int] = config_field(None, parse=optional(integer(minimum=1)))
    managed_gradient_accumulation: bool = config_field(True, parse=boolean())
    steps_per_print: float = config_field(10, parse=_steps_per_print)
    wall_clock_breakdown: bool = config_field(False, parse=boolean())
    memory_breakdown: bool = config_field(False, parse=boolean())
    dump_state: bool = config_field(False, parse=boolean())
    disable_python_gc: bool = config_field(False, parse=boolean())
    gradient_clipping: float = config_field(1.0, parse=number(minimum=0.0))
    prescale_gradients: bool = config_field(False, parse=boolean())
    gradient_predivide_factor: float = config_field(1.0, parse=number(minimum=0.0, exclusive_minimum=True))
    gradient_allreduce_op: str = config_field("mean", parse=_gradient_allreduce_op)
    communication_data_type: Optional[torch.dtype] = config_field(None, parse=optional(dtype()))
    seq_parallel_comm_data_type: torch.dtype = config_field(torch.float32,
                                                            parse=dtype(),
                                                            aliases=("seq_parallel_communication_data_type", ))
    sparse_gradients: bool = config_field(False, parse=boolean())
    disable_allgather: bool = config_field(False, parse=boolean())
    dataloader_drop_last: bool = config_field(False, parse=boolean())
    zero_allow_untested_optimizer: bool = config_field(False, parse=boolean())
    zero_force_ds_cpu_optimizer: bool = config_field(True, parse=boolean())
    sequence_parallel_size: Optional[int] = config_field(None, parse=optional(integer(minimum=1)))
    log_level: Optional[str] = config_field(None,
                                            parse=optional(
                                                one_of(("debug", "info", "warning", "error", "critical"),
                                                       convert=str.lower)))

    @classmethod
    def from_top_level(cls, param_dict: dict) -> "_TopLevelSettings":
        names = {n for spec in dataclasses.fields(cls) for n in (spec.name, ) + spec.metadata["aliases"]}
        return cls.from_dict({key: value for key, value in param_dict.items() if key in names}, "")


def _named_type(known: Tuple[str, ...], extra: dict, what: str):
    """Parser of an optimizer/scheduler ``type``: case-insensitive, returned in canonical spelling."""
    canonical = {name.lower(): name for name in known}
    canonical.update({key: value for key, value in extra.items() if key not in canonical})

    def parse(value, path):
        if isinstance(value, str) and value.lower() in canonical:
            return canonical[value.lower()]
        raise DeepSpeedConfigError(f"config key '{path}' must be one of {list(known)} or a {what} class name, "
                                   f"got {value!r}")

    return parse


@dataclasses.dataclass(frozen=True)
class _OptimizerSection(ConfigSection):
    type: Optional[str] = config_field(None, parse=_named_type(DEEPSPEED_OPTIMIZERS, TORCH_OPTIMIZERS, "torch.optim"))
    params: Optional[dict] = config_field(None, parse=optional(mapping()))
    legacy_fusion: bool = config_field(False, parse=boolean())

    @classmethod
    def _finalize(cls, values, spelled, path):
        if values.get("params") is not None and values.get("type") is None:
            raise DeepSpeedConfigError(f"config key '{path}.type' is required when '{path}.params' is given")
        return values


@dataclasses.dataclass(frozen=True)
class _SchedulerSection(ConfigSection):
    type: Optional[str] = config_field(None,
                                       parse=_named_type(DEEPSPEED_LR_SCHEDULES, TORCH_LR_SCHEDULERS,
                                                         "torch.optim.lr_scheduler"))
    params: Optional[dict] = config_field(None, parse=optional(mapping()))

    @classmethod
    def _finalize(cls, values, spelled, path):
        if values.get("params") is not None and values.get("type") is None:
            raise DeepSpeedConfigError(f"config key '{path}.type' is required when '{path}.params' is given")
        return values


@dataclasses.dataclass(frozen=True)
class _ActivationCheckpointingSection(ConfigSection):
    partition_activations: bool = config_field(False, parse=boolean())
    contiguous_memory_optimization: bool = config_field(False, parse=boolean())
    cpu_checkpointing: bool = config_field(False, parse=boolean())
    number_checkpoints: Optional[int] = config_field(None, parse=optional(integer(minimum=0)))
    synchronize_checkpoint_boundary: bool = config_field(False, parse=boolean())
    profile: bool = config_field(False, parse=boolean())


@dataclasses.dataclass(frozen=True)
class _CheckpointWriterSection(ConfigSection):
    type: str = config_field("FAST", parse=one_of(("mock", "python", "fast"), convert=str.upper))
    decoupled: bool = config_field(False, parse=boolean())
    io_buffer_size: int = config_field(64 * 1024**2, parse=size())
    io_buffer_double: bool = config_field(True, parse=boolean())
    show_statistics: bool = config_field(False, parse=boolean())
    data_parallel: Optional[str] = config_field(None,
                                                parse=optional(
                                                    one_of(("replica", "socket", "machine"), convert=str.upper)))
    io_multiplier: int = config_field(1, parse=integer(minimum=1))


@dataclasses.dataclass(frozen=True)
class _ParallelWriteSection(ConfigSection):
    pipeline_stage: bool = config_field(False, parse=boolean())


@dataclasses.dataclass(frozen=True)
class _CheckpointSection(ConfigSection):
    tag_validation: str = config_field(ValidationMode.WARN,
                                       parse=one_of(CHECKPOINT_TAG_VALIDATION_MODES, convert=str.upper))
    load_universal: bool = config_field(False, parse=boolean())
    # this package's key: "upstream" writes upstream DeepSpeed's layout (docs/checkpoints.md)
    save_format: str = config_field("native", parse=one_of(("native", "upstream")))
    use_node_local_storage: bool = config_field(False, parse=boolean())
    parallel_write: _ParallelWriteSection = config_field(default_factory=_ParallelWriteSection,
                                                         parse=section(_ParallelWriteSection))
    checkpoint_serialization: bool = config_field(True, parse=boolean())
    writer: Optional[_CheckpointWriterSection] = config_field(None, parse=optional(section(_CheckpointWriterSection)))


@dataclasses.dataclass(frozen=True)
class _AioSection(ConfigSection):
    block_size: int = config_field(1048576, parse=integer(minimum=1))
    queue_depth: int = config_field(8, parse=integer(minimum=1))
    thread_count: int = config_field(1, parse=integer(minimum=1), aliases=("intra_op_parallelism", ))
    single_submit: bool = config_field(False, parse=boolean())
    overlap_events: bool = config_field(True, parse=boolean())
    use_gds: bool = config_field(False, parse=boolean())


def _keep_in_fp32_setting(value, path):
    """``data_types.keep_in_fp32_modules``: "auto" or a list of name patterns (a list, as upstream accepts)."""
    if value == "auto" or (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        return value if value == "auto" else list(value)
    raise DeepSpeedConfigError(f"config key '{path}' must be \"auto\" or a list of name patterns, got {value!r}")


@dataclasses.dataclass(frozen=True)
class _DataTypesSection(ConfigSection):
    grad_accum_dtype: Optional[torch.dtype] = config_field(None, parse=optional(dtype()))
    param_dtype: Optional[torch.dtype] = config_field(None, parse=optional(dtype()))
    buffer_dtype: Optional[torch.dtype] = config_field(None, parse=optional(dtype()))
    # "auto" or a list of name patterns (deepspeed/runtime/keep_in_fp32.py)
    keep_in_fp32_modules: Any = config_field("auto", parse=_keep_in_fp32_setting)


@dataclasses.dataclass(frozen=True)
class _TorchAutocastSection(ConfigSection):
    enabled: bool = config_field(False, parse=boolean())
    dtype: Optional[torch.dtype] = config_field(None, parse=optional(dtype()))
    lower_precision_safe_modules: Optional[Tuple[str, ...]] = config_field(None, parse=optional(string_list()))


@dataclasses.dataclass(frozen=True)
class _EigenvalueSection(ConfigSection):
    """Upstream's keys and defaults; see ``deepspeed/runtime/eigenvalue.py``. ``layer_num`` 0 means every
    block of ``layer_name``."""
    enabled: bool = config_field(False, parse=boolean())
    verbose: bool = config_field(False, parse=boolean())
    max_iter: int = config_field(100, parse=integer(minimum=1))
    tol: float = config_field(1e-2, parse=number(minimum=0.0))
    stability: float = config_field(1e-6, parse=number(minimum=0.0))
    gas_boundary_resolution: int = config_field(1, parse=integer(minimum=1))
    layer_name: str = config_field("bert.encoder.layer", parse=string())
    layer_num: int = config_field(0, parse=integer(minimum=0))


def _loose_dict(param_dict: dict, key: str) -> dict:
    """A section kept as the user wrote it; it only has to be a dict (absent or null means empty)."""
    value = param_dict.get(key)
    return {} if value is None else mapping()(value, key)


#########################################
# Batch sizes
#########################################


def resolve_batch_sizes(train_batch_size: Optional[int], micro_batch_size: Optional[int],
                        gradient_accumulation_steps: Optional[int], world_size: int) -> Tuple[int, int, int]:
    """Complete ``train = micro * gas * world_size`` from the values given (None = not given).

    Any two determine the third, which must come out as a whole number; all three must agree; ``train``
    alone gives ``micro = train / world_size`` and ``gas = 1``; ``micro`` alone gives ``gas = 1``.
    ``gas`` alone, or nothing, is an error. Returns ``(train, micro, gas)``, all positive ints.
    """
    train, micro, gas, world = train_batch_size, micro_batch_size, gradient_accumulation_steps, world_size
    keys = "'train_batch_size', 'train_micro_batch_size_per_gpu', 'gradient_accumulation_steps'"

    def derive(numerator, denominator, derived_key, formula):
        if numerator % denominator != 0:
            raise DeepSpeedConfigError(
                f"config key '{derived_key}' cannot be derived: {formula} = {numerator} / {denominator} is not a "
                f"whole number (identity: train_batch_size = train_micro_batch_size_per_gpu * "
                f"gradient_accumulation_steps * world_size, world_size = {world})")
        return numerator // denominator

    if train is None and micro is None:
        given = "only 'gradient_accumulation_steps' is" if gas is not None else "none of them is"
        raise DeepSpeedConfigError(f"config must set 'train_batch_size' or 'train_micro_batch_size_per_gpu' "
                                   f"(of {keys}, {given} given)")
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world:
            raise DeepSpeedConfigError(
                f"config keys {keys} disagree: train_batch_size must equal train_micro_batch_size_per_gpu * "
                f"gradient_accumulation_steps * world_size, got {train} != {micro} * {gas} * {world}")
    elif train is not None and micro is not None:
        gas = derive(train, micro * world, "gradient_accumulation_steps",
                     "train_batch_size / (train_micro_batch_size_per_gpu * world_size)")
    elif train is not None and gas is not None:
        micro = derive(train, gas * world, "train_micro_batch_size_per_gpu",
                       "train_batch_size / (gradient_accumulation_steps * world_size)")
    elif micro is not None and gas is not None:
        train = micro * gas * world
    elif train is not None:
        gas = 1
        micro = derive(train, world, "train_micro_batch_size_per_gpu", "train_batch_size / world_size")
    else:
        gas = 1
        train = micro * world
    return train, micro, gas


def _data_parallel_world_size(mpu, mesh_device, world_size, sequence_parallel_size) -> Tuple[int, int]:
    """``(global_rank, dp_world_size)`` from the explicit argument, the mpu, the mesh or torch.distributed."""
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise DeepSpeedConfigError(
                f"DeepSpeedConfig argument world_size must be a positive int, got {world_size!r}")
        return rank, world_size
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        return rank, int(mpu.get_data_parallel_world_size())
    if not initialized:
        return rank, 1
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        sequence_parallel_size = int(mpu.get_sequence_parallel_world_size())
    elif mesh_device is not None:
        return rank, dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    total = dist.get_world_size()
    if sequence_parallel_size:
        if total % sequence_parallel_size != 0:
            raise DeepSpeedConfigError(f"config key '{SEQUENCE_PARALLEL_SIZE}' ({sequence_parallel_size}) must "
                                       f"divide the world size ({total})")
        return rank, total // sequence_parallel_size
    return rank, total


#########################################
# The config
#########################################


class DeepSpeedConfig:
    """The validated config of one engine.

    ``config`` is a dict (deep-copied) or a path to a JSON file. ``world_size`` is the data-parallel
    world size of the batch identity; when None it comes from ``mpu.get_data_parallel_world_size()``,
    else the ``mesh_device``'s data-parallel group, else ``torch.distributed`` (divided by
    ``sequence_parallel_size`` if set), else 1 when no process group is initialised.

    After construction every attribute holds a final, validated value; ``_param_dict`` is the user's
    dict, untouched.
    """

    def __init__(self, config, mpu=None, mesh_device=None, world_size: Optional[int] = None):
        self._param_dict = load_config(config)
        param_dict = drop_default_autos(self._param_dict)  # "auto" in zero_optimization: the default, as upstream
        raise_on_auto_values(param_dict)
        self._warn_unknown_top_level_keys(param_dict)

        top = _TopLevelSettings.from_top_level(param_dict)
        self.global_rank, self.world_size = _data_parallel_world_size(mpu, mesh_device, world_size,
                                                                      top.sequence_parallel_size)
        self._initialize_params(param_dict, top)
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = (
            resolve_batch_sizes(top.train_batch_size, top.train_micro_batch_size_per_gpu,
                                top.gradient_accumulation_steps, self.world_size))
        self._check_cross_section_rules()
        audit_config(self)  # upstream's keys this runtime does not act on: raise or warn (configuration/audit.py)

    @staticmethod
    def _warn_unknown_top_level_keys(param_dict: dict) -> None:
        unknown = sorted(str(key) for key in param_dict if key not in KNOWN_TOP_LEVEL_KEYS)
        if unknown:
            logger.warning(f"DeepSpeedConfig: ignoring unknown top-level config keys: {', '.join(unknown)}")

    def _initialize_params(self, param_dict: dict, top: _TopLevelSettings) -> None:
        self.managed_gradient_accumulation = top.managed_gradient_accumulation
        self.steps_per_print = top.steps_per_print
        self.wall_clock_breakdown = top.wall_clock_breakdown
        self.memory_breakdown = top.memory_breakdown
        self.dump_state = top.dump_state
        self.disable_python_gc = top.disable_python_gc  # deepspeed/runtime/python_gc.py
        self.gradient_clipping = top.gradient_clipping
        self.prescale_gradients = top.prescale_gradients
        self.gradient_predivide_factor = top.gradient_predivide_factor
        self.gradient_allreduce_op = top.gradient_allreduce_op
        self.communication_data_type = top.communication_data_type
        self.seq_parallel_communication_data_type = top.seq_parallel_comm_data_type
        self.sparse_gradients_enabled = top.sparse_gradients
        self.disable_allgather = top.disable_allgather
        self.dataloader_drop_last = top.dataloader_drop_last
        self.zero_allow_untested_optimizer = top.zero_allow_untested_optimizer
        self.zero_force_ds_cpu_optimizer = top.zero_force_ds_cpu_optimizer
        # validated (any case) by the section; kept as written, as upstream's config keeps it
        self.log_level = None if top.log_level is None else param_dict.get("log_level")

        from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config
        self.tensor_parallel_config = get_tensor_parallel_config(param_dict)  # the 'tensor_parallel' section

        self.zero_config: DeepSpeedZeroConfig = get_zero_config(param_dict)
        self.zero_optimization_stage = self.zero_config.stage
        self.zero_enabled = self.zero_optimization_stage > 0

        self._initialize_precision(param_dict)

        optimizer = _OptimizerSection.from_dict(param_dict.get(OPTIMIZER), OPTIMIZER)
        self.optimizer_name = optimizer.type.lower() if optimizer.type is not None else None
        self.optimizer_params = optimizer.params if optimizer.type is not None else None
        self.optimizer_legacy_fusion = optimizer.legacy_fusion
        scheduler = _SchedulerSection.from_dict(param_dict.get(SCHEDULER), SCHEDULER)
        self.scheduler_name = scheduler.type
        self.scheduler_params = scheduler.params if scheduler.type is not None else None

        self.activation_checkpointing_config = ConfigDict(
            _ActivationCheckpointingSection.from_dict(param_dict.get(ACTIVATION_CHECKPOINTING),
                                                      ACTIVATION_CHECKPOINTING).to_dict())
        checkpoint = _CheckpointSection.from_dict(param_dict.get(CHECKPOINT), CHECKPOINT)
        self.checkpoint_config = ConfigDict(checkpoint.to_dict())
        self.checkpoint_tag_validation_enabled = checkpoint.tag_validation != ValidationMode.IGNORE
        self.checkpoint_tag_validation_fail = checkpoint.tag_validation == ValidationMode.FAIL
        self.load_universal_checkpoint = checkpoint.load_universal
        self.checkpoint_save_format = checkpoint.save_format
        self.use_node_local_storage = checkpoint.use_node_local_storage
        self.checkpoint_parallel_write_pipeline = checkpoint.parallel_write.pipeline_stage
        from deepspeed.runtime.pipe.config import get_pipeline_config  # the "pipeline" section (docs/pipeline.md)
        self.pipeline = get_pipeline_config(param_dict)
        self.aio_config = ConfigDict(_AioSection.from_dict(param_dict.get(AIO), AIO).to_dict())

        data_types = _DataTypesSection.from_dict(param_dict.get(DATA_TYPES), DATA_TYPES)
        self.grad_accum_dtype = data_types.grad_accum_dtype
        self.param_dtype = data_types.param_dtype
        self.buffer_dtype = data_types.buffer_dtype
        self.keep_in_fp32_modules = data_types.keep_in_fp32_modules

        self.tensorboard_config = _loose_dict(param_dict, TENSORBOARD)
        self.csv_monitor_config = _loose_dict(param_dict, CSV_MONITOR)
        self.wandb_config = _loose_dict(param_dict, WANDB)
        self.comet_config = _loose_dict(param_dict, COMET)
        self._initialize_observability(param_dict)

        elasticity = _loose_dict(param_dict, ELASTICITY)
        if boolean()(elasticity.get("enabled", False), f"{ELASTICITY}.enabled"):
            raise DeepSpeedConfigError(f"config key '{ELASTICITY}.enabled' is true, but elastic training is not "
                                       "supported; remove the 'elasticity' section and set the batch sizes directly")

    def _initialize_observability(self, param_dict: dict) -> None:
        """The monitor, comms logger, flops profiler, eigenvalue and gradient audit sections (typed: unknown keys
        raise)."""
        from deepspeed.comm.config import DeepSpeedCommsConfig
        from deepspeed.monitor.config import get_monitor_config
        from deepspeed.profiling.config import get_flops_profiler_config
        self.monitor_config = get_monitor_config(param_dict)
        self.comms_config = DeepSpeedCommsConfig(param_dict)
        self.flops_profiler_config = get_flops_profiler_config(param_dict)
        self.eigenvalue_config = _EigenvalueSection.from_dict(param_dict.get(EIGENVALUE), EIGENVALUE)
        ev = self.eigenvalue_config
        self.eigenvalue_enabled = ev.enabled
        self.eigenvalue_verbose = ev.verbose
        self.eigenvalue_max_iter = ev.max_iter
        self.eigenvalue_tol = ev.tol
        self.eigenvalue_stability = ev.stability
        self.eigenvalue_gas_boundary_resolution = ev.gas_boundary_resolution
        self.eigenvalue_layer_name = ev.layer_name
        self.eigenvalue_layer_num = ev.layer_num
        from deepspeed.runtime.audit.config import get_gradient_audit_config
        self.gradient_audit_config = get_gradient_audit_config(param_dict)

    def _initialize_precision(self, param_dict: dict) -> None:
        self.float16_config: DeepSpeedFP16Config = get_float16_config(param_dict)
        self.bfloat16_config: DeepSpeedBF16Config = get_bfloat16_config(param_dict)
        self._bf16_section = bfloat16_section_name(param_dict)
        fp16, bf16 = self.float16_config, self.bfloat16_config
        self.fp16_enabled = fp16.enabled
        self.fp16_auto_cast = fp16.auto_cast
        self.fp16_master_weights_and_grads = fp16.fp16_master_weights_and_grads
        self.loss_scale = fp16.loss_scale
        self.initial_dynamic_scale = fp16.initial_dynamic_scale()
        self.dynamic_loss_scale_args = (fp16.dynamic_loss_scale_args()
                                        if fp16.enabled and fp16.dynamic_loss_scale else None)
        self.bfloat16_enabled = bf16.enabled
        self.bfloat16_immediate_grad_update = bf16.immediate_grad_update
        self.bfloat16_check_grad_overflow = bf16.check_grad_overflow
        # Whether a boundary step with a non-finite gradient is skipped: always for fp16 (overflow is how its
        # loss scale adapts), as `bf16.check_grad_overflow` says for bf16, never for fp32 (upstream's choice;
        # `engine.optimizer.check_grad_overflow = True` turns it on there).
        self.check_grad_overflow = fp16.enabled or (bf16.enabled and bf16.check_grad_overflow)
        self.bf16_master_weights_and_grads = bf16.bf16_master_weights_and_grads
        self.bf16_optimizer_states = bf16.bf16_optimizer_states

        amp = _loose_dict(param_dict, AMP)
        self.amp_enabled = boolean()(amp.get("enabled", False), f"{AMP}.enabled")
        self.amp_params = {key: value for key, value in amp.items() if key != "enabled"} if amp else False
        autocast = _TorchAutocastSection.from_dict(param_dict.get(TORCH_AUTOCAST), TORCH_AUTOCAST)
        self.torch_autocast_enabled = autocast.enabled
        self.torch_autocast_dtype = autocast.dtype
        self.torch_autocast_lower_precision_safe_modules = (list(
            autocast.lower_precision_safe_modules) if autocast.lower_precision_safe_modules is not None else None)

    def _check_cross_section_rules(self) -> None:
        """Rules that involve keys of more than one section."""
        if self.fp16_enabled and self.bfloat16_enabled:
            raise DeepSpeedConfigError(f"config keys 'fp16.enabled' and '{self._bf16_section}.enabled' are both "
                                       "true; enable at most one of them")
        stage = self.zero_optimization_stage
        from deepspeed.runtime.configuration.compile import parse_compile_section
        self.compile_settings = parse_compile_section(self._param_dict.get("compile"), stage)
        from deepspeed.moe.autoep_config import AutoEPConfig
        self.expert_parallel_config = AutoEPConfig.from_section(self._param_dict.get("expert_parallel"))
        if self.gradient_allreduce_op == GRADIENT_ALLREDUCE_OP_SUM:
            compile_section = self._param_dict.get("compile")
            conflict = None
            if stage == ZeroStageEnum.weights:
                conflict = "ZeRO stage 3 ('zero_optimization.stage' 3)"
            elif self.zero_config.zenflow is not None:
                conflict = "ZenFlow ('zero_optimization.zenflow')"
            elif isinstance(compile_section, dict) and compile_section.get("deepcompile"):
                conflict = "DeepCompile ('compile.deepcompile')"
            if conflict is not None:  # upstream's rules and wording
                raise DeepSpeedConfigError(f"config key 'gradient_allreduce_op' 'sum' is not supported with "
                                           f"{conflict}; use 'mean'")
        for enabled, key in ((self.fp16_master_weights_and_grads, "fp16.fp16_master_weights_and_grads"),
                             (self.bf16_master_weights_and_grads,
                              f"{self._bf16_section}.bf16_master_weights_and_grads"),
                             (self.bf16_optimizer_states, f"{self._bf16_section}.bf16_optimizer_states")):
            if enabled and stage not in (1, 2, 3):
                raise DeepSpeedConfigError(f"config key '{key}' requires 'zero_optimization.stage' 1, 2 or 3, got "
                                           f"{stage}")
        params = self.optimizer_params or {}
        clip = params.get(MAX_GRAD_NORM)
        if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0 and self.global_rank == 0:
            logger.warning(f"config key '{OPTIMIZER}.params.{MAX_GRAD_NORM}' is not used for clipping; set "
                           "'gradient_clipping' instead")

    def print_user_config(self) -> None:
        logger.info("  json = " + json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def print(self, name: str) -> None:
        """Log every resolved attribute, then the user's JSON."""
        logger.info(f"{name}:")
        for attr in sorted(vars(self)):
            if not attr.startswith("_"):
                logger.info(f"  {attr} {'.' * max(1, 29 - len(attr))} {getattr(self, attr)}")
        self.print_user_config()

    def __repr__(self) -> str:
        return (f"DeepSpeedConfig(world_size={self.world_size}, train_batch_size={self.train_batch_size}, "
                f"train_micro_batch_size_per_gpu={self.train_micro_batch_size_per_gpu}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
                f"zero_optimization_stage={self.zero_optimization_stage}, fp16_enabled={self.fp16_enabled}, "
                f"bfloat16_enabled={self.bfloat16_enabled}, optimizer_name={self.optimizer_name!r}, "
                f"scheduler_name={self.scheduler_name!r})")
