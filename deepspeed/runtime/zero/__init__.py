# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.zero``: ZeRO stages, and the ZeRO-3 construction/gathering API."""

from deepspeed.runtime.zero.partition_parameters import (  # noqa: F401
    DeepSpeedTensorOverride, GatheredParameters, Init, ZeroParamStatus, ZeroParamType, register_external_parameter,
    unregister_external_parameter)
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload  # noqa: F401
from deepspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias  # noqa: F401
from deepspeed.runtime.zero.units.generation import unwrap_model_for_generation  # noqa: F401
from deepspeed.runtime.zero import utils  # noqa: F401,E402  (code reaches deepspeed.runtime.zero.utils.* by attribute)
