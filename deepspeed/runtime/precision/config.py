# SPDX-License-Identifier: Apache-2.0
"""The ``fp16`` and ``bf16`` sections (``bfloat16`` is accepted as the older name of ``bf16``).

Keys and defaults are upstream's. ``fp16.loss_scale`` 0 selects dynamic loss scaling starting at
``2 ** initial_scale_power``; any positive value is a static scale. ``bf16.check_grad_overflow``
(default true, as upstream) skips a bf16 step whose gradients are not finite, as fp16 always does.

The fp16 numbers are checked as upstream 0.19.8 checks them, whether the section comes from a config dict or is
built with keywords (``DeepSpeedFP16Config(loss_scale=...)``, as upstream's tests and some tools build it):

* ``loss_scale``: anything ``float()`` reads (``"3"`` is 3.0), finite and ``>= 0``; never a bool;
* ``initial_scale_power``, ``hysteresis``, ``loss_scale_window``, ``min_loss_scale``: integers (an integral float
  or a string holding an integer is converted; a fraction, a non-finite number or a bool is refused);
* while dynamic loss scaling is on (``enabled`` and ``loss_scale`` 0), ``loss_scale_window`` and
  ``min_loss_scale`` must be positive; otherwise they are not used and any integer is accepted, as upstream.
  Here also ``hysteresis`` must be positive then (0 or less would never lower the scale) and
  ``2 ** initial_scale_power`` a finite, positive float (upstream accepts both and fails later, or never lowers
  the scale);
* the switches are bools (``true`` / ``false``; upstream also reads ``1`` or ``"yes"``; here they are refused,
  as in every section).
"""

import dataclasses
import math
import numbers

from ..config_utils import ConfigSection, DeepSpeedConfigError, boolean, config_field
from ..constants import BFLOAT16, BFLOAT16_OLD, FP16

# Keys of the dict returned by DeepSpeedFP16Config.dynamic_loss_scale_args(), as the loss scaler takes them.
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


def _loss_scale(value, path):
    """Upstream's rule: any value ``float()`` reads, except a bool; finite and ``>= 0``."""
    if isinstance(value, bool):
        raise DeepSpeedConfigError(f"config key '{path}' must be a number, not a bool (got {value!r})")
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise DeepSpeedConfigError(f"config key '{path}' must be a number, got {value!r} "
                                   f"({type(value).__name__})") from None
    if not math.isfinite(scale):
        raise DeepSpeedConfigError(f"config key '{path}' must be a finite number, got {value!r}")
    if scale < 0:
        raise DeepSpeedConfigError(f"config key '{path}' must be >= 0 (0 selects dynamic loss scaling), got "
                                   f"{value!r}")
    return scale


def _whole_number(value, path):
    """An integer as upstream's int fields take one: an int, an integral float or a string holding an integer;
    never a bool, a fraction or a non-finite number."""
    if isinstance(value, bool):
        raise DeepSpeedConfigError(f"config key '{path}' must be an integer, not a bool (got {value!r})")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DeepSpeedConfigError(f"config key '{path}' must be a finite integer, got {value!r}")
        if value.is_integer():
            return int(value)
    elif isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise DeepSpeedConfigError(f"config key '{path}' must be an integer, got {value!r} ({type(value).__name__})")


@dataclasses.dataclass(frozen=True)
class DeepSpeedFP16Config(ConfigSection):
    """Validated ``fp16`` settings (see the module docstring for the rules; they apply to keyword construction
    too)."""
    enabled: bool = config_field(False, parse=boolean())
    auto_cast: bool = config_field(False, parse=boolean())
    loss_scale: float = config_field(0.0, parse=_loss_scale)
    initial_scale_power: int = config_field(16, parse=_whole_number)
    loss_scale_window: int = config_field(1000, parse=_whole_number)
    hysteresis: int = config_field(2, parse=_whole_number)
    consecutive_hysteresis: bool = config_field(False, parse=boolean())
    min_loss_scale: int = config_field(1, parse=_whole_number)
    fp16_master_weights_and_grads: bool = config_field(False, parse=boolean())
    # Listed in upstream's older fp16 format; accepted and without effect.
    fused_mode: bool = config_field(True, parse=boolean())

    def __post_init__(self):
        for spec in dataclasses.fields(self):  # keyword construction skips from_dict: parse here (idempotent)
            value = spec.metadata["parse"](getattr(self, spec.name), f"{FP16}.{spec.name}")
            object.__setattr__(self, spec.name, value)
        if not (self.enabled and self.dynamic_loss_scale):
            return
        # The keys dynamic loss scaling reads: refused only while they are used, as upstream refuses them.
        for key in ("loss_scale_window", "min_loss_scale", "hysteresis"):
            if getattr(self, key) <= 0:
                raise DeepSpeedConfigError(f"config key '{FP16}.{key}' must be > 0 while dynamic loss scaling is on "
                                           f"('{FP16}.enabled' true, '{FP16}.loss_scale' 0), got {getattr(self, key)}")
        if not -1074 <= self.initial_scale_power <= 1023:
            raise DeepSpeedConfigError(f"config key '{FP16}.initial_scale_power' must be between -1074 and 1023 (2 ** "
                                       f"power is the first loss scale, a finite positive float), got "
                                       f"{self.initial_scale_power}")

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the loss scale adapts (``loss_scale`` is 0)."""
        return self.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        """The first dynamic loss scale, ``2 ** initial_scale_power`` (infinite past float range: a power that large
        is refused while dynamic scaling is on, and accepted unused otherwise)."""
        return float(2**self.initial_scale_power) if self.initial_scale_power <= 1023 else math.inf

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
