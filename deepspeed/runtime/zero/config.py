# SPDX-License-Identifier: Apache-2.0
"""The ``zero_optimization`` section.

Every key upstream documents is accepted, with upstream's defaults; an unknown key is an error.
Stage-3 keys may be written with or without their ``stage3_`` prefix (the field holds the short name,
and a ``stage3_*`` property reads it back). Keys that only tune performance are validated and kept
even where the runtime does not act on them.

Rules resolved here, so consumers see final values:

- ``overlap_comm`` unset means True for stage 3, False otherwise;
- the deprecated booleans ``cpu_offload`` / ``cpu_offload_param`` become an ``offload_optimizer`` /
  ``offload_param`` section on the CPU (``cpu_offload_use_pin_memory`` sets its ``pin_memory``);
- ``stage3_gather_fp16_weights_on_model_save`` is the old name of
  ``stage3_gather_16bit_weights_on_model_save``;
- partial (``ratio < 1``) optimizer offload requires stage 3.
"""

import dataclasses
import enum
import sys
from typing import List, Optional

from ..config_utils import (ConfigSection, DeepSpeedConfigError, boolean, config_field, integer, logger, mapping,
                            optional, section, size, string_list)
from ..constants import ZERO_OPTIMIZATION
from .offload_config import (DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum)
from ..zenflow.config import ZenFlowConfig


class ZeroStageEnum(int, enum.Enum):
    """ZeRO stages by name; members are ints (upstream pickles them in its ZeRO optimizer files)."""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


ZERO_STAGES = (0, 1, 2, 3)


class ConflictingZeroKeysError(DeepSpeedConfigError, AssertionError):
    """A deprecated ``zero_optimization`` key given together with the key that replaces it."""


_size = size()

DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


@dataclasses.dataclass(frozen=True)
class DeepSpeedZeroLeafModuleConfig(ConfigSection):
    """Modules ZeRO-3 treats as one unit (gathered whole, no hooks inside), by class path, name or suffix."""
    classes: List[str] = config_field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES), parse=string_list())
    names: List[str] = config_field(default_factory=list, parse=string_list())
    name_suffixes: List[str] = config_field(default_factory=list, parse=string_list())

    @classmethod
    def _finalize(cls, values, spelled, path):
        # lists without repeats, as upstream's section holds them (code compares them with lists)
        return {key: list(dict.fromkeys(items)) for key, items in values.items()}


@dataclasses.dataclass(frozen=True, init=False)
class DeepSpeedZeroConfig(ConfigSection):
    """Validated ``zero_optimization`` settings.

    Build with :func:`get_zero_config`, ``from_dict``, or upstream's keyword form
    ``DeepSpeedZeroConfig(**section)``: the keywords are the section's keys, with every alias
    (``stage3_prefetch_bucket_size``, ...) and deprecated key (``cpu_offload``, ``cpu_offload_param``,
    ``stage3_gather_fp16_weights_on_model_save``) and the same checks; a deprecated key given together
    with its replacement raises :class:`ConflictingZeroKeysError` (an ``AssertionError``, as upstream).
    """
    stage: int = config_field(0, parse=integer(choices=ZERO_STAGES))
    contiguous_gradients: bool = config_field(True, parse=boolean())
    reduce_scatter: bool = config_field(True, parse=boolean())
    reduce_bucket_size: int = config_field(int(5e8), parse=_size)
    use_multi_rank_bucket_allreduce: bool = config_field(True, parse=boolean())
    allgather_partitions: bool = config_field(True, parse=boolean())
    allgather_bucket_size: int = config_field(int(5e8), parse=_size)
    overlap_comm: Optional[bool] = config_field(None, parse=optional(boolean()))
    load_from_fp32_weights: bool = config_field(True, parse=boolean())
    elastic_checkpoint: bool = config_field(False, parse=boolean())
    offload_param: Optional[DeepSpeedZeroOffloadParamConfig] = config_field(
        None, parse=optional(section(DeepSpeedZeroOffloadParamConfig)))
    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = config_field(
        None, parse=optional(section(DeepSpeedZeroOffloadOptimizerConfig)))
    zenflow: Optional[ZenFlowConfig] = config_field(None, parse=optional(section(ZenFlowConfig)))
    sub_group_size: int = config_field(int(1e9), parse=_size)
    cpu_offload_param: Optional[bool] = config_field(None, parse=optional(boolean()))
    cpu_offload_use_pin_memory: Optional[bool] = config_field(None, parse=optional(boolean()))
    cpu_offload: Optional[bool] = config_field(None, parse=optional(boolean()))
    prefetch_bucket_size: int = config_field(int(5e7), parse=_size, aliases=("stage3_prefetch_bucket_size", ))
    param_persistence_threshold: int = config_field(int(1e5),
                                                    parse=_size,
                                                    aliases=("stage3_param_persistence_threshold", ))
    model_persistence_threshold: int = config_field(sys.maxsize,
                                                    parse=_size,
                                                    aliases=("stage3_model_persistence_threshold", ))
    max_live_parameters: int = config_field(int(1e9), parse=_size, aliases=("stage3_max_live_parameters", ))
    max_reuse_distance: int = config_field(int(1e9), parse=_size, aliases=("stage3_max_reuse_distance", ))
    gather_16bit_weights_on_model_save: bool = config_field(False,
                                                            parse=boolean(),
                                                            aliases=("stage3_gather_16bit_weights_on_model_save",
                                                                     "stage3_gather_fp16_weights_on_model_save"))
    module_granularity_threshold: int = config_field(0, parse=_size, aliases=("stage3_module_granularity_threshold", ))
    use_all_reduce_for_fetch_params: bool = config_field(False,
                                                         parse=boolean(),
                                                         aliases=("stage3_use_all_reduce_for_fetch_params", ))
    allgather_sequential: bool = config_field(False, parse=boolean(), aliases=("stage3_allgather_sequential", ))
    partition_stream_chunk_size: int = config_field(0, parse=_size, aliases=("stage3_partition_stream_chunk_size", ))
    ignore_unused_parameters: bool = config_field(True, parse=boolean())
    legacy_stage1: bool = config_field(False, parse=boolean())
    round_robin_gradients: bool = config_field(False, parse=boolean())
    zero_hpz_partition_size: int = config_field(1, parse=integer(minimum=0))
    zero_quantized_weights: bool = config_field(False, parse=boolean())
    zero_quantized_nontrainable_weights: bool = config_field(False, parse=boolean())
    zero_quantized_gradients: bool = config_field(False, parse=boolean())
    zeropp_loco_param: Optional[dict] = config_field(None, parse=optional(mapping()))
    memory_efficient_linear: bool = config_field(True, parse=boolean())
    pipeline_loading_checkpoint: bool = config_field(False, parse=boolean())
    override_module_apply: bool = config_field(True, parse=boolean())
    log_trace_cache_warnings: bool = config_field(False, parse=boolean())
    enable_sanity_checks: bool = config_field(False, parse=boolean())
    save_muon_momentum_buffer_in_memory: bool = config_field(False, parse=boolean())
    compute_grad_norm: bool = config_field(True, parse=boolean())
    parameter_alignment: bool = config_field(False, parse=boolean())
    leaf_module: DeepSpeedZeroLeafModuleConfig = config_field(default_factory=DeepSpeedZeroLeafModuleConfig,
                                                              parse=section(DeepSpeedZeroLeafModuleConfig))

    def __init__(self, **kwargs):
        built = type(self).from_dict(kwargs, ZERO_OPTIMIZATION)
        for spec in dataclasses.fields(self):
            object.__setattr__(self, spec.name, getattr(built, spec.name))

    @classmethod
    def _from_values(cls, values):
        built = object.__new__(cls)
        for spec in dataclasses.fields(cls):
            if spec.name in values:
                value = values[spec.name]
            elif spec.default_factory is not dataclasses.MISSING:
                value = spec.default_factory()
            else:
                value = spec.default
            object.__setattr__(built, spec.name, value)
        return built

    @classmethod
    def _finalize(cls, values, spelled, path):
        stage = values.get("stage", 0)
        if "zeropp_loco_param" in spelled:  # as upstream 0.19.8, which removed LoCo-ZeRO++
            raise DeepSpeedConfigError(f"config key '{path}.zeropp_loco_param' (LoCo-ZeRO++ error feedback for "
                                       "quantized gradients) is not supported, as in DeepSpeed 0.19.8 which removed "
                                       "it; remove the key ('zero_quantized_gradients' runs without error feedback)")
        if spelled.get("gather_16bit_weights_on_model_save") == "stage3_gather_fp16_weights_on_model_save":
            logger.warning(f"config key '{path}.stage3_gather_fp16_weights_on_model_save' is deprecated; use "
                           f"'{path}.stage3_gather_16bit_weights_on_model_save'")
        _migrate_cpu_offload(values, spelled, path, "cpu_offload", "offload_optimizer",
                             DeepSpeedZeroOffloadOptimizerConfig)
        _migrate_cpu_offload(values, spelled, path, "cpu_offload_param", "offload_param",
                             DeepSpeedZeroOffloadParamConfig)
        if values.get("overlap_comm") is None:
            values["overlap_comm"] = stage == ZeroStageEnum.weights
        if stage == ZeroStageEnum.weights and values.get("elastic_checkpoint"):
            # upstream's words and logger: ZeRO-3 elastic checkpointing is gone there; here the key has no effect
            from deepspeed.utils.logging import logger as ds_logger
            ds_logger.warning(f"config key '{path}.elastic_checkpoint': ZeRO-3 elastic checkpointing is deprecated "
                              "(upstream no longer supports it); it has no effect here, where load_checkpoint "
                              "reshards any checkpoint onto another world size")

        offload_optimizer = values.get("offload_optimizer")
        if offload_optimizer is not None and stage != ZeroStageEnum.weights:
            key = f"{path}.{spelled.get('offload_optimizer', 'offload_optimizer')}"
            if offload_optimizer.ratio < 1.0:
                raise DeepSpeedConfigError(f"config key '{key}.ratio' < 1 (partial offload) requires "
                                           f"'{path}.stage' 3, got stage {stage}")
        offload_param = values.get("offload_param")
        if (offload_param is not None and offload_param.device != OffloadDeviceEnum.none
                and stage != ZeroStageEnum.weights):
            raise DeepSpeedConfigError(f"config key '{path}.offload_param' (device "
                                       f"'{getattr(offload_param.device, 'value', offload_param.device)}') requires "
                                       f"'{path}.stage' 3, got stage {stage}: ZeRO stages 1 and 2 keep every "
                                       f"parameter whole on each device. Remove the section or set its device to "
                                       f"'none' (offload_optimizer offloads the optimizer state on stages 1-3)")
        return values

    @property
    def offload_optimizer_device(self) -> OffloadDeviceEnum:
        """``offload_optimizer.device``, or ``none`` when the section is absent."""
        return OffloadDeviceEnum.none if self.offload_optimizer is None else self.offload_optimizer.device

    @property
    def offload_param_device(self) -> OffloadDeviceEnum:
        """``offload_param.device``, or ``none`` when the section is absent."""
        return OffloadDeviceEnum.none if self.offload_param is None else self.offload_param.device

    # The stage-3 keys under their config spellings.
    @property
    def stage3_prefetch_bucket_size(self) -> int:
        return self.prefetch_bucket_size

    @property
    def stage3_param_persistence_threshold(self) -> int:
        return self.param_persistence_threshold

    @property
    def stage3_model_persistence_threshold(self) -> int:
        return self.model_persistence_threshold

    @property
    def stage3_max_live_parameters(self) -> int:
        return self.max_live_parameters

    @property
    def stage3_max_reuse_distance(self) -> int:
        return self.max_reuse_distance

    @property
    def stage3_gather_16bit_weights_on_model_save(self) -> bool:
        return self.gather_16bit_weights_on_model_save

    @property
    def stage3_gather_fp16_weights_on_model_save(self) -> bool:
        return self.gather_16bit_weights_on_model_save

    @property
    def stage3_module_granularity_threshold(self) -> int:
        return self.module_granularity_threshold

    @property
    def stage3_use_all_reduce_for_fetch_params(self) -> bool:
        return self.use_all_reduce_for_fetch_params


def _migrate_cpu_offload(values, spelled, path, old_key, new_key, new_cls):
    """Turn a deprecated ``cpu_offload*: true`` into the equivalent offload section."""
    if not values.get(old_key):
        return
    if values.get(new_key) is not None:
        raise ConflictingZeroKeysError(f"config keys '{path}.{old_key}' (deprecated) and '{path}.{new_key}' "
                                       f"cannot both be given; use only '{path}.{new_key}'")
    logger.warning(f"config key '{path}.{old_key}' is deprecated; use '{path}.{new_key}': "
                   "{\"device\": \"cpu\"}")
    values[new_key] = new_cls(device=OffloadDeviceEnum.cpu, pin_memory=bool(values.get("cpu_offload_use_pin_memory")))


# MiCS keys: refused whatever their value (see ``get_zero_config``)
REMOVED_MICS_KEYS = ("mics_shard_size", "mics_hierarchical_params_gather")


def get_zero_config(param_dict: dict) -> DeepSpeedZeroConfig:
    """Parse ``param_dict["zero_optimization"]`` (absent means stage 0).

    The legacy boolean form ``"zero_optimization": true`` means stage 1, with ``allgather_bucket_size``
    taken from the top-level ``allgather_size`` (default 5e8); ``false`` means stage 0.
    """
    raw = param_dict.get(ZERO_OPTIMIZATION)
    if isinstance(raw, dict):
        for key in REMOVED_MICS_KEYS:
            if key in raw:  # any value, as upstream 0.19.8 refuses them
                raise DeepSpeedConfigError(
                    f"config key '{ZERO_OPTIMIZATION}.{key}': MiCS ZeRO-3 sharding has been removed (upstream "
                    f"DeepSpeed 0.19.8 refuses the key as well); remove it: ZeRO-3 shards over the whole "
                    f"data-parallel group; see docs/compatibility.md")
    if isinstance(raw, bool):
        logger.warning(f"config key '{ZERO_OPTIMIZATION}' as a boolean is deprecated; use "
                       f"\"{ZERO_OPTIMIZATION}\": {{\"stage\": N, ...}}")
        raw = {"stage": 1, "allgather_bucket_size": param_dict.get("allgather_size", 5e8)} if raw else {}
    return DeepSpeedZeroConfig.from_dict(raw, ZERO_OPTIMIZATION)
