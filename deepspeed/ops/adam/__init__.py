# SPDX-License-Identifier: Apache-2.0
"""Adam optimizers: ``FusedAdam`` (device parameters) and ``DeepSpeedCPUAdam`` (offloaded states)."""

from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
from deepspeed.ops.adam.fused_adam import FusedAdam
from deepspeed.ops.adam.zenflow_torch_adam import ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3

__all__ = ['DeepSpeedCPUAdam', 'FusedAdam', 'ZenFlowSelectiveAdamW', 'ZenFlowSelectiveAdamW_stage3']
