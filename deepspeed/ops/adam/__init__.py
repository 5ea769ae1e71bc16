# SPDX-License-Identifier: Apache-2.0
"""Adam optimizers: ``FusedAdam`` (device parameters) and ``DeepSpeedCPUAdam`` (offloaded states)."""

from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
from deepspeed.ops.adam.fused_adam import FusedAdam

__all__ = ['DeepSpeedCPUAdam', 'FusedAdam']
