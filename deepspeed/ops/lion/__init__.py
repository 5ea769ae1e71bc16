# SPDX-License-Identifier: Apache-2.0
"""Lion optimizers: ``FusedLion`` (parameters on any device) and ``DeepSpeedCPULion`` (offloaded states)."""

from deepspeed.ops.lion.cpu_lion import DeepSpeedCPULion
from deepspeed.ops.lion.fused_lion import FusedLion

__all__ = ['DeepSpeedCPULion', 'FusedLion']
