# SPDX-License-Identifier: Apache-2.0
"""Adagrad for offloaded optimizer states: ``DeepSpeedCPUAdagrad``."""

from deepspeed.ops.adagrad.cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ['DeepSpeedCPUAdagrad']
