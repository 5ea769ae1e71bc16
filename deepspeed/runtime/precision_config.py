# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``deepspeed.runtime.precision_config``: the ``fp16`` and ``bf16`` sections.

The sections themselves live in :mod:`deepspeed.runtime.precision.config`; this module gives them upstream's
import path. ``get_float16_config(param_dict)`` / ``get_bfloat16_config(param_dict)`` parse the sections (``bf16``
or its old name ``bfloat16``); the loss-scaler argument names (``init_scale``, ``scale_window``,
``delayed_shift``, ``consecutive_hysteresis``, ``min_scale``) key ``DeepSpeedFP16Config.dynamic_loss_scale_args()``.
"""

from deepspeed.runtime.constants import BFLOAT16, BFLOAT16_OLD, FP16  # noqa: F401
from deepspeed.runtime.precision.config import (  # noqa: F401
    CONSECUTIVE_HYSTERESIS, DELAYED_SHIFT, INITIAL_LOSS_SCALE, MIN_LOSS_SCALE, SCALE_WINDOW, DeepSpeedBF16Config,
    DeepSpeedFP16Config, get_bfloat16_config, get_float16_config)

__all__ = [
    "FP16", "BFLOAT16", "BFLOAT16_OLD", "INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT",
    "CONSECUTIVE_HYSTERESIS", "MIN_LOSS_SCALE", "DeepSpeedFP16Config", "DeepSpeedBF16Config", "get_float16_config",
    "get_bfloat16_config"
]
