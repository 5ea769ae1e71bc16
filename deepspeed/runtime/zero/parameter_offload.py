# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``deepspeed.runtime.zero.parameter_offload``: the ZeRO-3 module-hook manager.

Upstream's ``DeepSpeedZeRoOffload`` installs the forward/backward hooks that gather and release a ZeRO-3
model's parameters, and is what ``engine.optimizer`` is on stage 3 without an optimizer. Here that job is
done by the stage's ``UnitCoordinator`` (``parameter_units.py``), built by ``deepspeed.initialize``; an engine
without an optimizer has ``engine.optimizer = None``. Constructing ``DeepSpeedZeRoOffload`` directly is not
built and raises ``NotImplementedError``.

``partitioned_param_data_shape`` is the shape of a released parameter's ``.data`` (``[0]``).
"""

from deepspeed.runtime.zero.partition_parameters import (  # noqa: F401
    DEFAULT_TENSOR_OVERRIDES, DeepSpeedTensorOverride, partitioned_param_data_shape)

FWD_MODULE_STACK = []


class DeepSpeedZeRoOffload:
    """Upstream's ZeRO-3 hook manager: not built as a standalone object (see the module docstring)."""

    def __init__(self, module, timers, ds_config, *args, **kwargs):
        raise NotImplementedError("DeepSpeedZeRoOffload (upstream's ZeRO-3 hook manager) is not built as a standalone "
                                  "object in this runtime: deepspeed.initialize with zero_optimization.stage 3 "
                                  "installs the equivalent hooks; see docs/compatibility.md")
