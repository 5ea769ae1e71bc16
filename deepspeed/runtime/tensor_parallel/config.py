# SPDX-License-Identifier: Apache-2.0
"""The ``tensor_parallel`` config section (automatic tensor parallelism for training), upstream's keys and defaults.

======================  ==========  ==========================================================
key                     default     meaning
======================  ==========  ==========================================================
autotp_size             0           tensor-parallel size; 0 or 1: no tensor parallelism
dtype                   fp16        the dtype ``tp_model_init`` must agree with
tp_overlap_comm         false       overlap the input gradient's all-reduce with the weight
                                    gradient (column-parallel layers)
tp (alias               {}          ``tp_size`` (1 or autotp_size), ``tp_grain_size`` (1: the
tensor_parallel)                    unit of an even cut), ``mpu``, ``tp_group``
partition_config        null        ``use_default_specs``, ``layer_specs`` ... (autotp_config.py)
preset_model            null        llama, bloom, chatglm, mixtral, deepseek_v2, qwen2, phi3
keep_module_on_host     false       accepted: the cut is made where the model is, before it moves
injection_policy_tuple  null        inference injection: only null is accepted
kernel_inject           false       inference kernels: only false is accepted
(replace_with_kernel_inject)
======================  ==========  ==========================================================

Every value is checked here, on every rank, before any collective (:class:`DeepSpeedConfigError`
names the key); unknown keys raise as upstream's pydantic model does.
"""

import dataclasses
from enum import Enum
from typing import Any, Optional

import torch

from deepspeed.runtime.config_utils import (ConfigSection, DeepSpeedConfigError, boolean, config_field, dtype, integer,
                                            optional, section)

TENSOR_PARALLEL = "tensor_parallel"


class AUTOTP_MODE(Enum):
    TRAINING = "TRAINING"
    INFERENCE = "INFERENCE"


def _anything(value, path):
    return value


def _not_supported(default, what):

    def parse(value, path):
        if value != default:
            raise NotImplementedError(f"config key '{path}'={value!r} ({what}) is not supported in training; see "
                                      f"docs/tensor_parallel.md")
        return value

    return parse


def _preset(value, path):
    from deepspeed.module_inject.autotp_config import PRESETS
    if not isinstance(value, str) or value.lower() not in PRESETS:
        raise DeepSpeedConfigError(f"config key '{path}' must be one of {sorted(PRESETS)}, got {value!r}")
    return value.lower()


_LAYER_SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output",
                    "grad_allreduce")
_PARTITION_KEYS = ("use_default_specs", "layer_specs", "tp_size", "embedding_partition_dim", "lm_head_patterns",
                   "strict_mode")


def _partition_config(value, path):
    """A dict of the keys of ``AutoTPConfig``; its layer specs are built (and so checked) here."""
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    if not isinstance(value, dict):
        raise DeepSpeedConfigError(f"config key '{path}' must be a dict, got {type(value).__name__}")
    for key in value:
        if key not in _PARTITION_KEYS:
            raise DeepSpeedConfigError(f"unknown config key '{path}.{key}'; valid keys: {', '.join(_PARTITION_KEYS)}")
    specs = value.get("layer_specs", [])
    if not isinstance(specs, list):
        raise DeepSpeedConfigError(f"config key '{path}.layer_specs' must be a list, got {type(specs).__name__}")
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise DeepSpeedConfigError(f"config key '{path}.layer_specs[{i}]' must be a dict")
        for key in spec:
            if key not in _LAYER_SPEC_KEYS:
                raise DeepSpeedConfigError(f"unknown config key '{path}.layer_specs[{i}].{key}'; valid keys: "
                                           f"{', '.join(_LAYER_SPEC_KEYS)}")
        for key in ("gather_output", "grad_allreduce"):
            if key in spec:
                boolean()(spec[key], f"{path}.layer_specs[{i}].{key}")
    try:
        AutoTPConfig.from_dict(value)
    except (ValueError, TypeError) as err:
        raise DeepSpeedConfigError(f"config key '{path}': {err}") from None
    return dict(value)


@dataclasses.dataclass(frozen=True)
class TPConfig(ConfigSection):
    """``tensor_parallel.tp``."""
    tp_size: int = config_field(1, parse=integer(minimum=1))
    tp_grain_size: int = config_field(1, parse=integer(minimum=1))
    mpu: Any = config_field(None, parse=_anything)
    tp_group: Any = config_field(None, parse=_anything)


@dataclasses.dataclass(frozen=True)
class TPTrainingConfig(ConfigSection):
    """The ``tensor_parallel`` section (module docstring)."""
    dtype: torch.dtype = config_field(torch.float16, parse=dtype())
    autotp_size: int = config_field(0, parse=integer(minimum=0))
    tp_overlap_comm: bool = config_field(False, parse=boolean())
    tensor_parallel: TPConfig = config_field(default_factory=TPConfig, parse=section(TPConfig), aliases=("tp", ))
    injection_policy_tuple: Optional[tuple] = config_field(None, parse=_not_supported(None, "inference injection"))
    partition_config: Optional[dict] = config_field(None, parse=optional(_partition_config))
    preset_model: Optional[str] = config_field(None, parse=optional(_preset))
    keep_module_on_host: bool = config_field(False, parse=boolean())
    replace_with_kernel_inject: bool = config_field(False,
                                                    parse=_not_supported(False, "inference kernels"),
                                                    aliases=("kernel_inject", ))

    @classmethod
    def _finalize(cls, values, spelled, path):
        size = values.get("autotp_size", 0)
        tp = values.get("tensor_parallel")
        if tp is not None and tp.tp_size not in (1, size) and size > 1:
            raise DeepSpeedConfigError(f"config key '{path}.tp.tp_size' ({tp.tp_size}) must be 1 or equal "
                                       f"'{path}.autotp_size' ({size})")
        return values

    @property
    def tp_size(self):
        """The tensor-parallel size (1 when tensor parallelism is off)."""
        return max(1, self.autotp_size)

    def get_partition_config_object(self):
        """The rules of ``preset_model`` and ``partition_config`` as one ``AutoTPConfig`` (None: neither set)."""
        from deepspeed.module_inject.autotp_config import AutoTPConfig, AutoTPPresets, merge_autotp_configs
        config = AutoTPPresets.get_preset(self.preset_model) if self.preset_model else None
        if self.partition_config is not None:
            custom = AutoTPConfig.from_dict(self.partition_config)
            config = merge_autotp_configs(config,
                                          custom) if config is not None and custom.use_default_specs else custom
        if config is not None:
            config.tp_size = self.tp_size
        return config


def get_tensor_parallel_config(ds_config):
    """The section of a config dict, parsed (the defaults when it is absent)."""
    section_value = ds_config.get(TENSOR_PARALLEL) if isinstance(ds_config, dict) else None
    return TPTrainingConfig.from_dict(section_value, TENSOR_PARALLEL)


def _get_hf_tp_plan(model):
    """The model's Hugging Face tensor-parallel plan: the config's ``base_model_tp_plan`` (under the base model's
    prefix) merged with the class's and the instance's ``_tp_plan``; None when there is none.

    Transformers fills the instance's plan with the base plan's patterns under the base model's prefix
    (``model.layers.*.q_proj`` beside ``layers.*.q_proj``). A pattern matches a parameter path by its end, so such a
    copy matches nothing the earlier pattern does not: it is left out, and the plan holds each rule once."""
    config = getattr(model, "config", None)
    plans = (getattr(config, "base_model_tp_plan",
                     None), getattr(type(model), "_tp_plan", None), getattr(model, "__dict__", {}).get("_tp_plan"))
    merged = {}
    for plan in plans:
        if not isinstance(plan, dict):
            continue
        for pattern, style in plan.items():
            if pattern not in merged and any(str(pattern).endswith("." + str(seen)) for seen in merged):
                continue
            merged[pattern] = style
    return merged or None
