# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.zero``: ZeRO stages, and the ZeRO-3 construction/gathering API."""

from deepspeed.runtime.zero.partition_parameters import (  # noqa: F401
    GatheredParameters, Init, ZeroParamStatus, register_external_parameter, unregister_external_parameter)
