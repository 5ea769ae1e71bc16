# SPDX-License-Identifier: Apache-2.0
"""The ``fp16`` and ``bf16`` sections (``bfloat16`` is accepted as the older name of ``bf16``).

Keys and defaults are upstream's. ``fp16.loss_scale`` 0 selects dynamic loss scaling starting at
``2 ** initial_scale_power``; any positive value is a static scale. ``bf16.check_grad_overflow``
(default true, as upstream) skips a bf16 step whose gradients are not finite, as fp16 always does.
"""

import dataclasses

from ..config_utils import ConfigSection, DeepSpeedConfigError, boolean, config_field, integer, number
from ..constants import BFLOAT16, BFLOAT16_OLD, FP16

# Keys of the dict returned by DeepSpeedFP16Config.dynamic_loss_scale_args(), as the loss scaler takes them.
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


@dataclasses.dataclass(frozen=True)
class DeepSpeedFP16Config(ConfigSection):
    """Validated ``fp16`` settings."""
    enabled: bool = config_field(False, parse=boolean())
    auto_cast: bool = config_field(False, parse=boolean())
    loss_scale: float = config_field(0.0, parse=number(minimum=0.0))
    initial_scale_power: int = config_field(16, parse=integer(minimum=0, maximum=1023))
    loss_scale_window: int = config_field(1000, parse=integer(minimum=1))
    hysteresis: int = config_field(2, parse=integer(minimum=1))
    consecutive_hysteresis: bool = config_field(False, parse=boolean())
    min_loss_scale: float = config_field(1.0, parse=number(minimum=0.0, exclusive_minimum=True))
    fp16_master_weights_and_grads: bool = config_field(False, parse=boolean())
    # Listed in upstream's older fp16 format; accepted and without effect.
    fused_mode: bool = config_field(True, parse=boolean())

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the loss scale adapts (``loss_scale`` is 0)."""
        return self.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        """The first dynamic loss scale, ``2 ** initial_scale_power``."""
        return float(2**self.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict:
        """Arguments of the dynamic loss scaler (the keys upstream's scaler takes)."""
        return {
            INITIAL_LOSS_SCALE: self.initial_dynamic_scale(),
            SCALE_WINDOW: self.loss_scale_window,
            DELAYED_SHIFT: self.hysteresis,
            CONSECUTIVE_HYSTERESIS: self.consecutive_hysteresis,
            MIN_LOSS_SCALE: self.min_loss_scale,
        }


@dataclasses.dataclass(frozen=True)
class DeepSpeedBF16Config(ConfigSection):
    """Validated ``bf16`` settings."""
    enabled: bool = config_field(False, parse=boolean())
    immediate_grad_update: bool = config_field(False, parse=boolean())
    check_grad_overflow: bool = config_field(True, parse=boolean())
    bf16_master_weights_and_grads: bool = config_field(False, parse=boolean())
    bf16_optimizer_states: bool = config_field(False, parse=boolean())

    @classmethod
    def _finalize(cls, values, spelled, path):
        if values.get("bf16_optimizer_states") and not values.get("bf16_master_weights_and_grads"):
            raise DeepSpeedConfigError(f"config key '{path}.bf16_optimizer_states' requires "
                                       f"'{path}.bf16_master_weights_and_grads' to be true")
        return values


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    """Parse ``param_dict["fp16"]`` (absent means disabled)."""
    return DeepSpeedFP16Config.from_dict(param_dict.get(FP16), FP16)


def bfloat16_section_name(param_dict: dict) -> str:
    """The key holding the bf16 section: ``bf16``, or the older ``bfloat16``. Both at once is an error."""
    if BFLOAT16 in param_dict and BFLOAT16_OLD in param_dict:
        raise DeepSpeedConfigError(f"config keys '{BFLOAT16}' and '{BFLOAT16_OLD}' both given; "
                                   f"use only '{BFLOAT16}'")
    return BFLOAT16_OLD if BFLOAT16_OLD in param_dict else BFLOAT16


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    """Parse the ``bf16`` (or ``bfloat16``) section (absent means disabled)."""
    name = bfloat16_section_name(param_dict)
    return DeepSpeedBF16Config.from_dict(param_dict.get(name), name)
