# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``get_<key>(param_dict)`` readers of a raw config dict (re-exported by ``deepspeed.runtime.config``).

Each returns the key's value as written, or upstream's default when it is absent; they do not validate
(``DeepSpeedConfig`` does). Code written against upstream uses them to peek at a config before building an
engine.
"""

from ..config_utils import DeepSpeedConfigError, get_scalar_param
from ..constants import (
    CHECKPOINT, CHECKPOINT_PARALLEL_WRITE, CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE,
    CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT, CHECKPOINT_TAG_VALIDATION, CHECKPOINT_TAG_VALIDATION_DEFAULT,
    CHECKPOINT_TAG_VALIDATION_MODES, COMMUNICATION_DATA_TYPE, COMMUNICATION_DATA_TYPE_DEFAULT, DATA_TYPES,
    DATALOADER_DROP_LAST, DATALOADER_DROP_LAST_DEFAULT, DISABLE_ALLGATHER, DISABLE_ALLGATHER_DEFAULT,
    DISABLE_PYTHON_GC, DISABLE_PYTHON_GC_DEFAULT, DUMP_STATE, DUMP_STATE_DEFAULT, GRADIENT_ACCUMULATION_STEPS,
    GRADIENT_ACCUMULATION_STEPS_DEFAULT, GRADIENT_ALLREDUCE_OP, GRADIENT_ALLREDUCE_OP_DEFAULT,
    GRADIENT_ALLREDUCE_OP_SUPPORTED, GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT, GRADIENT_PREDIVIDE_FACTOR,
    GRADIENT_PREDIVIDE_FACTOR_DEFAULT, LEGACY_FUSION, LEGACY_FUSION_DEFAULT, LOG_LEVEL, LOG_LEVEL_DEFAULT,
    MANAGED_GRADIENT_ACCUMULATION, MANAGED_GRADIENT_ACCUMULATION_DEFAULT, MAX_GRAD_NORM, MEMORY_BREAKDOWN,
    MEMORY_BREAKDOWN_DEFAULT, OPTIMIZER, OPTIMIZER_PARAMS, OPTIMIZER_TYPE_DEFAULT, PRESCALE_GRADIENTS,
    PRESCALE_GRADIENTS_DEFAULT, SCHEDULER, SCHEDULER_PARAMS, SCHEDULER_TYPE_DEFAULT, STEPS_PER_PRINT,
    STEPS_PER_PRINT_DEFAULT, TORCH_AUTOCAST, TORCH_AUTOCAST_DTYPE, TORCH_AUTOCAST_ENABLED,
    TORCH_AUTOCAST_ENABLED_DEFAULT, TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES, TRAIN_BATCH_SIZE,
    TRAIN_BATCH_SIZE_DEFAULT, TRAIN_MICRO_BATCH_SIZE_PER_GPU, TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT, TYPE,
    USE_DATA_BEFORE_EXPERT_PARALLEL, USE_DATA_BEFORE_EXPERT_PARALLEL_DEFAULT, WALL_CLOCK_BREAKDOWN,
    WALL_CLOCK_BREAKDOWN_DEFAULT, ZERO_ALLOW_UNTESTED_OPTIMIZER, ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT,
    ZERO_FORCE_DS_CPU_OPTIMIZER, ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT)

_DTYPE_NAMES = {
    "fp32": "float32", "float32": "float32", "float": "float32",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
}  # yapf: disable


def _section(param_dict, key):
    return param_dict.get(key) or {}


def get_train_batch_size(param_dict):
    return get_scalar_param(param_dict, TRAIN_BATCH_SIZE, TRAIN_BATCH_SIZE_DEFAULT)


def get_train_micro_batch_size_per_gpu(param_dict):
    return get_scalar_param(param_dict, TRAIN_MICRO_BATCH_SIZE_PER_GPU, TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT)


def get_gradient_accumulation_steps(param_dict):
    return get_scalar_param(param_dict, GRADIENT_ACCUMULATION_STEPS, GRADIENT_ACCUMULATION_STEPS_DEFAULT)


def get_managed_gradient_accumulation(param_dict):
    return get_scalar_param(param_dict, MANAGED_GRADIENT_ACCUMULATION, MANAGED_GRADIENT_ACCUMULATION_DEFAULT)


def get_gradient_clipping(param_dict):
    """``gradient_clipping`` (default 1.0)."""
    return get_scalar_param(param_dict, GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT)


def get_prescale_gradients(param_dict):
    return get_scalar_param(param_dict, PRESCALE_GRADIENTS, PRESCALE_GRADIENTS_DEFAULT)


def get_gradient_predivide_factor(param_dict):
    return get_scalar_param(param_dict, GRADIENT_PREDIVIDE_FACTOR, GRADIENT_PREDIVIDE_FACTOR_DEFAULT)


def get_gradient_allreduce_op(param_dict):
    """``gradient_allreduce_op`` lower-cased; a value other than ``mean``/``sum`` raises."""
    value = get_scalar_param(param_dict, GRADIENT_ALLREDUCE_OP, GRADIENT_ALLREDUCE_OP_DEFAULT)
    value = value.lower() if isinstance(value, str) else value
    if value not in GRADIENT_ALLREDUCE_OP_SUPPORTED:
        raise DeepSpeedConfigError(f"config key '{GRADIENT_ALLREDUCE_OP}' must be one of "
                                   f"{list(GRADIENT_ALLREDUCE_OP_SUPPORTED)}, got {value!r}")
    return value


def get_communication_data_type(param_dict,
                                comm_type=COMMUNICATION_DATA_TYPE,
                                comm_data_type_default=COMMUNICATION_DATA_TYPE_DEFAULT):
    """The torch dtype named by ``comm_type`` (``fp32``, ``fp16``, ``bf16``), or the default (None)."""
    import torch
    value = get_scalar_param(param_dict, comm_type, comm_data_type_default)
    if value is None or isinstance(value, torch.dtype):
        return value
    name = _DTYPE_NAMES.get(str(value).lower())
    if name is None:
        raise DeepSpeedConfigError(f"config key '{comm_type}' must be one of 'fp32', 'fp16', 'bf16', got {value!r}")
    return getattr(torch, name)


def get_steps_per_print(param_dict):
    return get_scalar_param(param_dict, STEPS_PER_PRINT, STEPS_PER_PRINT_DEFAULT)


def get_disable_allgather(param_dict):
    return get_scalar_param(param_dict, DISABLE_ALLGATHER, DISABLE_ALLGATHER_DEFAULT)


def get_dump_state(param_dict):
    return get_scalar_param(param_dict, DUMP_STATE, DUMP_STATE_DEFAULT)


def get_disable_python_gc(param_dict):
    return get_scalar_param(param_dict, DISABLE_PYTHON_GC, DISABLE_PYTHON_GC_DEFAULT)


def get_wall_clock_breakdown(param_dict):
    return get_scalar_param(param_dict, WALL_CLOCK_BREAKDOWN, WALL_CLOCK_BREAKDOWN_DEFAULT)


def get_memory_breakdown(param_dict):
    return get_scalar_param(param_dict, MEMORY_BREAKDOWN, MEMORY_BREAKDOWN_DEFAULT)


def get_dataloader_drop_last(param_dict):
    return get_scalar_param(param_dict, DATALOADER_DROP_LAST, DATALOADER_DROP_LAST_DEFAULT)


def get_log_level(param_dict):
    """``log_level`` (``"debug"`` ... ``"critical"``), None when absent."""
    return get_scalar_param(param_dict, LOG_LEVEL, LOG_LEVEL_DEFAULT)


def get_zero_allow_untested_optimizer(param_dict):
    return get_scalar_param(param_dict, ZERO_ALLOW_UNTESTED_OPTIMIZER, ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT)


def get_zero_force_ds_cpu_optimizer(param_dict):
    return get_scalar_param(param_dict, ZERO_FORCE_DS_CPU_OPTIMIZER, ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT)


def get_expert_data_topo_config(param_dict):
    return get_scalar_param(param_dict, USE_DATA_BEFORE_EXPERT_PARALLEL, USE_DATA_BEFORE_EXPERT_PARALLEL_DEFAULT)


def get_optimizer_name(param_dict):
    """``optimizer.type`` as written, None without one."""
    return _section(param_dict, OPTIMIZER).get(TYPE, OPTIMIZER_TYPE_DEFAULT)


def get_optimizer_params(param_dict):
    """``optimizer.params`` when an optimizer type is given, else None."""
    if get_optimizer_name(param_dict) is None:
        return None
    return _section(param_dict, OPTIMIZER).get(OPTIMIZER_PARAMS)


def get_optimizer_gradient_clipping(param_dict):
    """``optimizer.params.max_grad_norm``, None when absent."""
    return (get_optimizer_params(param_dict) or {}).get(MAX_GRAD_NORM)


def get_optimizer_legacy_fusion(param_dict):
    return _section(param_dict, OPTIMIZER).get(LEGACY_FUSION, LEGACY_FUSION_DEFAULT)


def get_scheduler_name(param_dict):
    return _section(param_dict, SCHEDULER).get(TYPE, SCHEDULER_TYPE_DEFAULT)


def get_scheduler_params(param_dict):
    if get_scheduler_name(param_dict) is None:
        return None
    return _section(param_dict, SCHEDULER).get(SCHEDULER_PARAMS)


def get_checkpoint_params(param_dict):
    return param_dict.get(CHECKPOINT, {})


def get_data_types_params(param_dict):
    return param_dict.get(DATA_TYPES, {})


def get_checkpoint_tag_validation_mode(checkpoint_params):
    """``tag_validation`` upper-cased (``WARN`` by default); another value raises."""
    mode = str(checkpoint_params.get(CHECKPOINT_TAG_VALIDATION, CHECKPOINT_TAG_VALIDATION_DEFAULT)).upper()
    if mode not in CHECKPOINT_TAG_VALIDATION_MODES:
        raise DeepSpeedConfigError(f"config key 'checkpoint.{CHECKPOINT_TAG_VALIDATION}' must be one of "
                                   f"{list(CHECKPOINT_TAG_VALIDATION_MODES)}, got {mode!r}")
    return mode


def get_checkpoint_parallel_write_pipeline(checkpoint_params):
    value = checkpoint_params.get(CHECKPOINT_PARALLEL_WRITE, {}).get(CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE,
                                                                     CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT)
    if value not in (True, False):
        raise DeepSpeedConfigError(f"config key 'checkpoint.{CHECKPOINT_PARALLEL_WRITE}."
                                   f"{CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE}' must be a bool, got {value!r}")
    return value


def get_torch_autocast_enabled(param_dict):
    return _section(param_dict, TORCH_AUTOCAST).get(TORCH_AUTOCAST_ENABLED, TORCH_AUTOCAST_ENABLED_DEFAULT)


def get_torch_autocast_dtype(param_dict):
    """The torch dtype of ``torch_autocast.dtype``, None when absent."""
    value = _section(param_dict, TORCH_AUTOCAST).get(TORCH_AUTOCAST_DTYPE)
    if value is None:
        return None
    return get_communication_data_type({TORCH_AUTOCAST_DTYPE: value}, TORCH_AUTOCAST_DTYPE)


def get_lower_precision_safe_modules(param_dict):
    """``torch_autocast.lower_precision_safe_modules`` (class paths), None when absent; non-strings raise."""
    modules = _section(param_dict, TORCH_AUTOCAST).get(TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES)
    if modules is None:
        return None
    if not all(isinstance(name, str) for name in modules):
        raise DeepSpeedConfigError(f"config key '{TORCH_AUTOCAST}.{TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES}' "
                                   f"must be a list of class paths (strings), got {modules!r}")
    return list(modules)


__all__ = [name for name in dir() if name.startswith("get_") and name != "get_scalar_param"]
